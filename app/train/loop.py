"""The FlowGRPO training loop of one Ray Train worker. One step, top to bottom (`train_step`):

 1. prompts      this worker's share of the step's prompt groups (a pure function of seed and step)
 2. rollouts     the groups from the rollout deployment; each is scored by the reward deployment as soon as it
                 exists. On-policy (`train.max_staleness: 0`): every group comes from the adapter of the previous
                 step. Pipelined (k >= 1): the groups were generated while earlier steps trained, with the adapter
                 the replicas had; one more than k versions old is regenerated. Then the groups of step + k are
                 requested, to generate while this step trains (the schedule: app/train/schedule.py)
 3. advantages   per prompt group, over the whole step's batch (every worker sees every reward)
 4. old log-probs  the rollout's own (`train.old_logprob: rollout`), recomputed, or the first pass's own
                 (`trainer`: exact under torch.compile); the rollout↔trainer mismatch is logged
 5. update       per pass (app/train/update.py): a fraction of the timesteps in micro-batches, clipped
                 loss + β·KL, backward; gradient clipping; one optimizer step
 6. publish      the new adapter to the adapter store and every live rollout replica: groups started from now on
                 sample from it (on-policy: the step waits for every replica; pipelined: it goes on in the background)
 7. report       metrics (tensorboard, Ray metrics, `ray.train.report`; phase times, useful FLOPs, MFU, peak
                 GPU memory) and, every few steps, a checkpoint

All ranks make the same FSDP2 calls in the same order: every worker owns the same number of groups, trains the
same number of timesteps and micro-batches. `ray.train` appears in this module only.
"""

from __future__ import annotations

import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import ray.train
import torch
import torch.distributed as dist

from app import metrics as run_metrics
from app.algo.advantages import step_advantages
from app.algo.timesteps import trained_steps
from app.config import RunConfig
from app.console import quiet_this_process
from app.flops import group_flops
from app.metrics import PhaseTimer, Stats, busy_shares, reduce_over_workers, reward_metrics, throughput
from app.models.compile import cache_counts, compile_counts, skip_guard_evaluation
from app.prompt_sets import load_prompts
from app.rollout.client import BlockingRolloutClient, RolloutClient, ScoredGroup
from app.startup import startup_metrics
from app.train import checkpoint
from app.train.evaluation import RunEvaluator, eval_due
from app.train.policy import Policy
from app.train.schedule import OnPolicySchedule, rollout_schedule
from app.train.update import make_optimizer, recompute_log_probs, train_pass
from app.types import LoraAdapter


@dataclass
class Worker:
    """What one worker holds for the whole run."""

    config: RunConfig
    rank: int
    world: int
    policy: Policy
    optimizer: torch.optim.Optimizer
    schedule: OnPolicySchedule  # when groups are generated and adapters published (app/train/schedule.py)
    state: checkpoint.TrainerState
    adapter: LoraAdapter | None = None  # what the replicas serve (None: the base model)
    log: run_metrics.RunLog | run_metrics.NullRunLog = field(default_factory=run_metrics.NullRunLog)  # rank 0 logs
    evaluator: RunEvaluator | None = None  # rank 0, with evaluation on (eval.every, eval.before_train)
    compiled_frames: int = 0  # dynamo frames this process had compiled at the end of the last step
    replica_starts: dict[str, tuple[float, float]] = field(default_factory=dict)  # replica -> (constructed, serving)


def replica_dtype(config: RunConfig) -> torch.dtype:
    """What adapters travel in: the replicas' compute dtype (they would cast to it anyway)."""
    return getattr(torch, config.model.dtype)


def train_loop_per_worker(loop_config: dict) -> None:
    """Ray Train entry point. loop_config: {"config": RunConfig, "run_dir": absolute path of the run folder,
    "rollout", "reward", "adapters": DeploymentHandles of the application serving the rollouts and rewards,
    "startup": the driver's start-up marks (app/startup.py; optional)}."""
    marks = {"entered": time.time()}
    config = loop_config["config"]
    client = RolloutClient(loop_config["rollout"], loop_config["reward"], loop_config["adapters"],
                           retries=config.rollout.request_retries, publish_dtype=replica_dtype(config))
    with BlockingRolloutClient(client) as rollout:
        worker = _setup(config, Path(loop_config["run_dir"]), rollout, marks)
        try:
            for step in range(worker.state.step, config.train.num_steps):
                first = step == worker.state.step and "first_step_began" not in marks
                if first:
                    marks["first_step_began"] = time.time()
                metrics = train_step(worker, step)
                if first:  # where the start went: logged with this run's first step (a resumed run's too)
                    marks["first_step_done"] = time.time()
                    skip_guard_evaluation(config.model.compile)  # `guards: skip`: every graph is made by now
                    metrics.update(startup_metrics(loop_config.get("startup", {}), marks,
                                                   list(worker.replica_starts.values())))
                if worker.evaluator is not None and eval_due(config, step):
                    worker.schedule.finish()  # pipelined: the replicas serve the adapter just published
                    worker.evaluator.after_step(step + 1, worker.adapter.version)
                _report(worker, step, metrics)
            worker.schedule.finish()  # the replicas serve the final adapter when the run returns
        finally:
            worker.log.close()


def train_step(worker: Worker, step: int) -> dict[str, float]:
    train, timer = worker.config.train, PhaseTimer()

    # 1-2. this worker's share of the step's prompt groups, generated and scored (rewards streamed in as groups
    # finish): on-policy, now, from the adapter published last; pipelined, while earlier steps trained
    with timer("rollout"):
        groups, regenerated = worker.schedule.groups(step, worker.adapter, worker.state.adapter_version)
    # pipelined: the next steps' groups start generating, with the adapter published last
    lost_replicas = worker.schedule.before_training(step, worker.state.adapter_version)
    trajectories = [s.trajectory for s in groups]
    for traj in trajectories:  # when each replica started (app/startup.py)
        if "replica_start" in traj.producer:
            worker.replica_starts[traj.producer.get("replica", "")] = tuple(traj.producer["replica_start"])

    # 3. advantages per prompt group, normalised over the whole step's batch (every worker's rewards: waiting for
    # them is waiting for the slowest worker's groups, so it counts as the rollout's)
    with timer("rollout"):
        rewards = _gather_rewards(groups)  # {group id: RewardScores}
    adv_of, adv_metrics = step_advantages({g: r.total for g, r in rewards.items()}, std_mode=train.adv_std_mode,
                                          clip_max=train.adv_clip_max)
    advantages = [adv_of[traj.group_id] for traj in trajectories]

    # 4. old log-probs: what the rollout recorded, or the current policy's (before any update this step; with
    # old_logprob=trainer the first pass scores them itself, and the rollout's weigh each term as the behaviour's)
    mismatch, old = Stats(), [traj.log_probs for traj in trajectories]  # [n, T] each
    if train.old_logprob == "recompute":
        with timer("recompute"):
            old = recompute_log_probs(worker.policy, train, trajectories, mismatch, step=step)

    # 5. update: one optimizer step per pass over the batch
    stats = Stats()
    with timer("train"):
        for epoch in range(train.num_inner_epochs):
            grad_norm = train_pass(worker.policy, worker.optimizer, train, step=step, epoch=epoch,
                                   trajectories=trajectories, advantages=advantages, old=old, stats=stats,
                                   mismatch=mismatch, policy_version=worker.state.adapter_version)

    # 6. publish: groups started from now on sample the new adapter (on-policy: every replica serves it before any
    # worker asks for the next step's groups; pipelined: it travels while the next step's groups are collected)
    with timer("publish"):
        # gathers the LoRA only (a collective), in what it travels in (the replicas' dtype: they cast to it anyway)
        worker.adapter = worker.policy.export_adapter(version=step + 1, dtype=replica_dtype(worker.config))
        lost_replicas += worker.schedule.publish(worker.adapter)

    # 7. metrics over every worker, and (rank 0's log) the step's images
    local = _worker_metrics(worker, step, groups, stats.result(), mismatch.result(), regenerated, lost_replicas)
    worker.state = checkpoint.TrainerState(step=step + 1, adapter_version=worker.adapter.version,
                                           data_position=(step + 1) * train.groups_per_step, seed=train.seed)
    _log_images(worker, step, groups)
    return _step_metrics(worker, local, rewards, adv_metrics, grad_norm, timer)


def _worker_metrics(worker: Worker, step: int, groups: list[ScoredGroup], stats: dict, mismatch: dict,
                    regenerated: int, lost_replicas: int) -> dict[str, float]:
    """This worker's metrics of the step, named for how they combine over workers (`reduce_over_workers`: `_max`,
    `_min`, `_sum`, else the mean). The first-pass checks cover the groups of the policy's own version; every rank
    reports every key (0: no such group on this worker)."""
    train = worker.config.train
    staleness = [worker.state.adapter_version - s.trajectory.lora_version for s in groups]  # 0: on-policy
    tflop = 0.0
    for s in groups:  # useful FLOPs (app/flops.py) of the groups this worker trained
        traj = s.trajectory
        trained = train.num_inner_epochs * len(trained_steps(traj.stochastic_steps, train.timestep_fraction,
                                                             seed=train.seed, step=step, group=traj.group_id, epoch=0))
        tflop += group_flops(worker.policy.family, worker.policy.transformer.config, traj, trained_steps=trained,
                             kl=train.kl_beta > 0)["total"] / 1e12
    out = {"actor/ratio_dev_first_pass_max": 0.0, "actor/ratio_dev_stale_max": 0.0,
           "rollout/logprob_mismatch_max": 0.0, **stats, **mismatch,
           "rollout/staleness_max": float(max(staleness)), "rollout/staleness_mean": sum(staleness) / len(staleness),
           "rollout/regenerated_groups": float(regenerated),
           "rollout/retries_max": float(sum(s.retries for s in groups)),  # failed attempts seen by one worker
           "rollout/publish_lost_replicas_max": float(lost_replicas),
           # the adapter's way to the replicas (pipelined: the last step's, behind this step's generation)
           "timing/publication_s_max": worker.schedule.publication_s,
           "perf/useful_tflop_sum": tflop,
           "perf/rollout_busy_s_sum": sum(s.trajectory.producer.get("seconds", 0.0) for s in groups),
           "perf/reward_busy_s_sum": sum(s.rewards.seconds for s in groups),  # the reward replicas' own seconds
           "rollout/adapter_swap_s_max": max(s.trajectory.producer.get("adapter_swap_s", 0.0) for s in groups),
           "timing/reward_wait_s_max": max(0.0, max(s.scored_at for s in groups) - max(s.generated_at for s in groups)),
           "memory/rollout_peak_gib_max": max(s.trajectory.producer.get("gpu_peak_gib", 0.0) for s in groups),
           # what one group weighs on its way from a replica (video groups: latents of every step, frames)
           "rollout/trajectory_mb_max": max(s.trajectory.nbytes for s in groups) / 2**20}
    for s in groups:  # where an in-process engine's time went: encode, denoise, decode (logged `perf/rollout_*_s`)
        for phase, seconds in s.trajectory.producer.get("phase_s", {}).items():
            out[f"perf/rollout_{phase}_s_sum"] = out.get(f"perf/rollout_{phase}_s_sum", 0.0) + seconds
    if any("ode_forwards" in s.trajectory.producer or "ode_fp8_layers" in s.trajectory.producer for s in groups):
        # `rollout.ode_steps`: the cached share of the step's ODE forwards, the FP8 weights' quantization
        forwards = sum(s.trajectory.producer.get("ode_forwards", 0) for s in groups)
        cached = sum(s.trajectory.producer.get("ode_forwards_cached", 0) for s in groups)
        out["rollout/ode_cached_share"] = cached / forwards if forwards else 0.0
        out["rollout/ode_fp8_quantize_s_sum"] = sum(s.trajectory.producer.get("ode_fp8_quantize_s", 0.0)
                                                    for s in groups)
    if worker.policy.compiled:  # compilations so far (steady state: neither grows from step to step)
        out.update(_compile_metrics(worker, groups))
    if torch.cuda.is_available():
        out["memory/trainer_peak_gib_max"] = torch.cuda.max_memory_allocated() / 2**30
    return out


def _compile_metrics(worker: Worker, groups: list[ScoredGroup]) -> dict[str, float]:
    """Compilations so far (`_frames_max`: the most any one process has compiled) and this step's new ones, counted
    in the process that compiled them and summed: `compile/trainer_new_frames` over the ranks since their last
    step, `compile/rollout_new_frames` over the step's groups while each was generated (its replica's count). A
    maximum alone hides a rank that compiles what another compiled steps before (seen on 4 GPUs). Steady state:
    both new counts stay 0 after a process's first step."""
    frames = compile_counts()["frames"]
    out = {"compile/trainer_frames_max": float(frames),
           "compile/trainer_new_frames_sum": float(frames - worker.compiled_frames),
           "compile/rollout_frames_max": float(max(s.trajectory.producer.get("compile_frames", 0) for s in groups)),
           "compile/rollout_new_frames_sum": float(sum(s.trajectory.producer.get("compile_frames_new", 0)
                                                       for s in groups))}
    worker.compiled_frames = frames
    for name, count in cache_counts().items():  # the shared cache, as this worker's process met it
        out[f"compile/trainer_{name}_max"] = float(count)
    for s in groups:  # and as each replica met it (in-process engines; a fresh machine given a cache: no misses)
        for name, count in s.trajectory.producer.get("compile_cache", {}).items():
            key = f"compile/rollout_{name}_max"
            out[key] = max(out.get(key, 0.0), float(count))
    return out


def _step_metrics(worker: Worker, local: dict[str, float], rewards: dict, adv_metrics: dict, grad_norm: float,
                  timer: PhaseTimer) -> dict[str, float]:
    """The step's metrics: every worker's reduced (a collective), the rewards and advantages of the whole batch,
    the phase times, and throughput and busy shares from the FLOPs and engine seconds summed over workers."""
    cfg = worker.config
    out = {**reduce_over_workers(local, worker.world), **reward_metrics(rewards), **adv_metrics,
           "actor/grad_norm": grad_norm, "actor/lr": worker.optimizer.param_groups[0]["lr"],
           "rollout/adapter_version": float(worker.adapter.version),
           "rollout/images": float(sum(len(r.total) for r in rewards.values())), **timer.metrics()}
    out.update(throughput(out, useful_tflop=out.pop("perf/useful_tflop"), gpus=_gpus(cfg)))
    out.update(busy_shares(out, rollout_busy_s=out["perf/rollout_busy_s"],
                           replicas=cfg.rollout.num_replicas, replica_gpus=cfg.rollout.replica_num_gpus,
                           workers=cfg.cluster.num_workers,
                           worker_gpus=cfg.cluster.worker_num_gpus if cfg.cluster.use_gpu else 0.0))
    return out


def _log_images(worker: Worker, step: int, groups: list[ScoredGroup]) -> None:
    """The step's image grid, labelled with prompts and rewards, when one is due (rank 0's log draws it)."""
    if _log_images_now(worker.config, step):
        images = np.concatenate([s.trajectory.images.numpy() for s in groups])
        worker.log.log_images(step + 1, images, [s.trajectory.prompt for s in groups],
                              [{"total": s.rewards.total, **s.rewards.components} for s in groups])


def _gpus(cfg: RunConfig) -> float:
    """GPUs the run holds: rollout replicas' and training workers' (0 on CPUs)."""
    rollout = cfg.rollout.num_replicas * cfg.rollout.replica_num_gpus
    return rollout + (cfg.cluster.num_workers * cfg.cluster.worker_num_gpus if cfg.cluster.use_gpu else 0.0)


def _gather_rewards(groups: list[ScoredGroup]) -> dict:
    """{global group index: RewardScores} of every worker's groups."""
    mine = {s.trajectory.group_id: s.rewards for s in groups}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return {g: r for part in everyone for g, r in part.items()}


def _log_images_now(cfg: RunConfig, step: int) -> bool:
    every = cfg.logging.image_every
    return step + 1 == cfg.train.num_steps or (every > 0 and (step + 1) % every == 0) or step == 0


def _checkpoint_now(cfg: RunConfig, step: int) -> bool:
    every = cfg.train.checkpoint_every
    return step + 1 == cfg.train.num_steps or (every > 0 and (step + 1) % every == 0)


def _report(worker: Worker, step: int, metrics: dict[str, float]) -> None:
    """Log (rank 0) and report the step to Ray Train, with a checkpoint when one is due (every rank writes its
    part into a folder of the same name; Ray Train merges them into `<run_dir>/checkpoints/`)."""
    worker.log.step_done(step, metrics)
    if not _checkpoint_now(worker.config, step):
        ray.train.report(metrics)
        return
    with tempfile.TemporaryDirectory() as tmp:
        # the adapter as trained (fp32), gathered again: what was published may be in the replicas' dtype
        checkpoint.save(tmp, policy=worker.policy, optimizer=worker.optimizer, state=worker.state, rank=worker.rank)
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(tmp),
                         checkpoint_dir_name=f"checkpoint_step_{step + 1:06d}")


def _setup(config: RunConfig, run_dir: Path, rollout: BlockingRolloutClient, marks: dict[str, float]) -> Worker:
    """The worker's policy, optimizer, schedule and (rank 0) log and evaluator; `marks` gets the start-up marks
    policy_built and setup_done."""
    quiet_this_process(config.logging.verbose)  # e.g. Serve's INFO line when this worker's handles connect
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    torch.set_num_threads(max(1, int(config.cluster.worker_num_cpus)))
    model, train = config.model, config.train
    restored = None
    ckpt = ray.train.get_checkpoint()  # set when this run is resumed (same run folder)
    if ckpt is not None:
        with ckpt.as_directory() as directory:
            restored = checkpoint.load(directory, rank=rank)
        if restored.rng is not None:
            torch.set_rng_state(restored.rng)
    device = ray.train.torch.get_device() if config.cluster.use_gpu else torch.device("cpu")
    policy = Policy.from_pretrained(
        Path(model.path).resolve(), lora_rank=model.lora_rank, lora_alpha=model.lora_alpha,
        target_modules=model.lora_targets,
        dtype=getattr(torch, model.dtype), device=device, seed=train.seed,
        adapter_tensors=restored.adapter if restored else None, gradient_checkpointing=train.gradient_checkpointing,
        family=model.family, compile=model.compile, activation_memory_budget=train.activation_memory_budget,
        reshard_after_forward=train.reshard_after_forward, attention_kernels=model.attention_kernels)
    optimizer = make_optimizer(policy, train)
    marks["policy_built"] = time.time()
    state = checkpoint.TrainerState(seed=train.seed)
    adapter = None
    if restored is not None:
        checkpoint.restore_optimizer(policy, optimizer, restored.optimizer)
        state = restored.state
        adapter = (policy.export_adapter(version=state.adapter_version, dtype=replica_dtype(config))
                   if state.adapter_version > 0 else None)
    schedule = rollout_schedule(config, rollout, load_prompts(config.data.prompts), rank=rank, world=world)
    worker = Worker(config=config, rank=rank, world=world, policy=policy, optimizer=optimizer, schedule=schedule,
                    state=state, adapter=adapter)
    if rank == 0:
        worker.log = run_metrics.RunLog(run_dir, first_step=state.step, total_steps=train.num_steps)
        # the replicas serve exactly this run's policy: the base model, or the resumed adapter (reset first: a
        # replica may serve an adapter of the same version number from an earlier run, or from before a restart)
        rollout.publish(None)
        if config.eval.enabled:  # while the base model is served: the sentinels' reference, eval.before_train
            worker.evaluator = RunEvaluator(config, run_dir, rollout, writer=worker.log.writer)
            worker.evaluator.start(state.step)
        if adapter is not None:
            rollout.publish(adapter)
        if restored is not None:
            print(f"[flowgrpo] continuing from the checkpoint of step {state.step}", file=sys.__stdout__, flush=True)
    dist.barrier()
    marks["setup_done"] = time.time()
    return worker
