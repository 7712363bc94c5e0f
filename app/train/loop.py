"""The FlowGRPO training loop of one Ray Train worker. One step, top to bottom (`train_step`):

 1. prompts      this worker's share of the step's prompt groups (a pure function of seed and step)
 2. rollouts     the groups from the rollout deployment; each is scored by the reward deployment as soon as it
                 exists; every group must come from the adapter of the previous step (checked, logged)
 3. advantages   per prompt group, over the whole step's batch (every worker sees every reward)
 4. old log-probs  the rollout's own (`train.old_logprob: rollout`) or recomputed; their mismatch is logged
 5. update       per pass: a fraction of the timesteps in micro-batches, clipped loss + β·KL, backward;
                 gradient clipping; one optimizer step
 6. publish      the new adapter to the adapter store and every live rollout replica: step k+1 samples from it
 7. report       metrics (tensorboard, Ray metrics, `ray.train.report`) and, every few steps, a checkpoint

All ranks make the same FSDP2 calls in the same order: every worker owns the same number of groups, trains the
same number of timesteps and micro-batches. `ray.train` appears in this module only.
"""

from __future__ import annotations

import asyncio
import math
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import ray.train
import torch
import torch.distributed as dist

from app import metrics as run_metrics
from app.algo.advantages import group_advantages
from app.algo.loss import flow_grpo_loss, transition_kl
from app.config import RunConfig
from app.console import quiet_this_process
from app.rollout.client import RolloutClient, ScoredGroup
from app.train import checkpoint
from app.train.policy import Policy
from app.train.prompts import group_seed, load_prompts, step_prompts
from app.types import GenerationRequest, LoraAdapter


@dataclass
class Worker:
    """What one worker holds for the whole run."""

    config: RunConfig
    rank: int
    world: int
    policy: Policy
    optimizer: torch.optim.Optimizer
    client: RolloutClient
    aio: asyncio.Runner
    prompts: list[str]
    state: checkpoint.TrainerState
    adapter: LoraAdapter | None = None  # what the replicas serve (None: the base model)
    log: run_metrics.RunLog | None = None  # rank 0 only
    ray_metrics: run_metrics.RayMetrics | None = None
    progress: Progress | None = None


def train_loop_per_worker(loop_config: dict) -> None:
    """Ray Train entry point. loop_config: {"config": RunConfig, "run_dir": absolute path of the run folder,
    "rollout", "reward", "adapters": DeploymentHandles of the application serving the rollouts and rewards}."""
    with asyncio.Runner() as aio:
        config = loop_config["config"]
        client = RolloutClient(loop_config["rollout"], loop_config["reward"], loop_config["adapters"],
                               retries=config.rollout.request_retries)
        worker = _setup(config, Path(loop_config["run_dir"]), client, aio)
        cfg = worker.config.train
        try:
            for step in range(worker.state.step, cfg.num_steps):
                metrics = train_step(worker, step)
                _report(worker, step, metrics)
        finally:
            if worker.log is not None:
                worker.log.close()


def train_step(w: Worker, step: int) -> dict[str, float]:
    cfg, t = w.config, w.config.train
    started = time.perf_counter()

    # 1. prompts: groups step*G .. step*G+G-1, dealt round-robin to the workers
    mine = step_prompts(w.prompts, step, t.groups_per_step, seed=t.seed, shuffle=cfg.data.shuffle)[w.rank::w.world]
    requests = [rollout_request(cfg, prompt, g, lora_version=w.state.adapter_version) for g, prompt in mine]

    # 2. rollouts, rewards streamed in as groups finish, all from the adapter the replicas were given last
    groups, regenerated = _collect_on_policy(w, requests)
    staleness = max(w.state.adapter_version - s.trajectory.lora_version for s in groups)  # 0: all on-policy
    rollout_s = time.perf_counter() - started

    # 3. advantages per prompt group, normalised over the whole step's batch
    rewards = _gather_rewards(groups)  # every group of every worker: {g: RewardScores}
    ids = sorted(rewards)
    total = torch.tensor([rewards[g].total for g in ids], dtype=torch.float64)  # [G, n]
    group_index = torch.tensor(ids).repeat_interleave(total.shape[1])  # [G·n]
    adv_flat, adv_metrics = group_advantages(total.flatten(), group_index, std_mode=t.adv_std_mode,
                                             clip_max=t.adv_clip_max)
    adv_of = {g: adv_flat.view(len(ids), -1)[k] for k, g in enumerate(ids)}  # g -> [n]
    advantages = [adv_of[s.trajectory.group_id] for s in groups]

    # 4. old log-probs: what the rollout recorded, or the current policy's (before any update this step)
    mismatch = Stats()
    old = [s.trajectory.log_probs for s in groups]  # [n, T] each
    if t.old_logprob == "recompute":
        old = _recompute_log_probs(w, groups, mismatch)

    # 5. update: one optimizer step per pass over the batch
    train_started = time.perf_counter()
    stats = Stats()
    grad_norm = 0.0
    for epoch in range(t.num_inner_epochs):
        w.optimizer.zero_grad(set_to_none=True)
        first_pass = epoch == 0
        for s, adv, old_lp in zip(groups, advantages, old, strict=True):
            traj = s.trajectory
            steps = trained_steps(traj.num_inference_steps, t.timestep_fraction, seed=t.seed, step=step,
                                  group=traj.group_id, epoch=epoch)
            weight = 1.0 / (len(groups) * traj.group_size * len(steps))  # loss = mean over this worker's terms
            for start in range(0, traj.group_size, t.micro_batch_size):
                samples = list(range(start, start + t.micro_batch_size))
                for i in steps:
                    loss, m = _step_loss(w, traj, i, samples, adv[samples], old_lp[samples, i])
                    (loss * weight * len(samples)).backward()
                    stats.add(m, len(samples))
                    if first_pass:  # nothing has been updated yet: the trainer must score what the rollout did
                        stats.add({"actor/ratio_dev_first_pass_max": m["actor/ratio_dev_max"]})
                        if t.old_logprob == "rollout":
                            mismatch.add({"rollout/logprob_mismatch_max": m["actor/log_ratio_abs_max"]})
        norm = torch.nn.utils.clip_grad_norm_(w.policy.parameters(), t.max_grad_norm)
        grad_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)  # a DTensor under FSDP2
        w.optimizer.step()
    train_s = time.perf_counter() - train_started

    # 6. publish: the replicas serve the new adapter before any worker asks for the next step's rollouts
    publish_started = time.perf_counter()
    w.adapter = w.policy.export_adapter(version=step + 1)  # gathers the LoRA only (a collective)
    lost_replicas = 0
    if w.rank == 0:
        lost_replicas = w.aio.run(w.client.publish(w.adapter)).lost
    dist.barrier()
    w.state = checkpoint.TrainerState(step=step + 1, adapter_version=w.adapter.version,
                                      data_position=(step + 1) * t.groups_per_step, seed=t.seed)

    # 7. metrics, averaged (or max/min) over workers
    local = {**stats.result(), **mismatch.result(),
             "rollout/staleness_max": float(staleness),
             "rollout/regenerated_groups": float(regenerated),
             "rollout/retries_max": float(sum(s.retries for s in groups)),  # failed attempts seen by one worker
             "rollout/publish_lost_replicas_max": float(lost_replicas)}
    out = {**_reduce_over_workers(local, w.world), **_reward_metrics(rewards), **adv_metrics,
           "actor/grad_norm": grad_norm, "actor/lr": w.optimizer.param_groups[0]["lr"],
           "rollout/adapter_version": float(w.adapter.version), "rollout/images": float(total.numel()),
           "timing/rollout_s": rollout_s, "timing/train_s": train_s,
           "timing/publish_s": time.perf_counter() - publish_started,
           "timing/step_s": time.perf_counter() - started}
    if w.rank == 0 and _log_images_now(cfg, step):
        images = np.concatenate([s.trajectory.images.numpy() for s in groups])
        w.log.log_images(step + 1, images, [s.trajectory.prompt for s in groups],
                         [{"total": s.rewards.total, **s.rewards.components} for s in groups])
    return out


def rollout_request(cfg: RunConfig, prompt: str, group: int, lora_version: int | None = None) -> GenerationRequest:
    r = cfg.rollout
    return GenerationRequest(
        prompt=prompt, n=r.group_size, height=r.height, width=r.width, num_inference_steps=r.num_inference_steps,
        guidance_scale=r.guidance_scale, negative_prompt=r.negative_prompt if r.guidance_scale > 1 else None,
        noise_level=r.noise_level, sde_type=r.sde_type, seed=group_seed(cfg.train.seed, group),
        group_id=group, lora_version=lora_version)


def trained_steps(num_inference_steps: int, fraction: float, *, seed: int, step: int, group: int,
                  epoch: int) -> list[int]:
    """Which denoising steps of a group are trained: round(fraction·T) of them (at least one), drawn without
    replacement from a generator seeded by (seed, step, group, epoch); all of them when fraction = 1."""
    k = max(1, round(fraction * num_inference_steps))
    if k >= num_inference_steps:
        return list(range(num_inference_steps))
    rng = np.random.default_rng([seed, step, group, epoch])
    return sorted(int(i) for i in rng.choice(num_inference_steps, size=k, replace=False))


def _step_loss(w: Worker, traj, i: int, samples: list[int], adv: torch.Tensor, old_lp: torch.Tensor):
    """Clipped FlowGRPO loss (+ β·KL to the adapter-free reference) of step i for some members of a group."""
    t = w.config.train
    (out,) = w.policy.score(traj, [i], samples, flow_grpo_compat=t.flow_grpo_compat)
    kl = None
    if t.kl_beta > 0:
        with torch.no_grad(), w.policy.reference():
            (ref,) = w.policy.score(traj, [i], samples, flow_grpo_compat=t.flow_grpo_compat)
        kl = transition_kl(out.prev_sample_mean, ref.prev_sample_mean, out.kl_std(t.flow_grpo_compat))
    return flow_grpo_loss(out.log_prob, old_lp.to(out.log_prob), adv.to(out.log_prob), clip_range=t.clip_range,
                          kl=kl, kl_beta=t.kl_beta)


@torch.no_grad()
def _recompute_log_probs(w: Worker, groups: list[ScoredGroup], mismatch: Stats) -> list[torch.Tensor]:
    """Old log-probs [n, T] per group from the current policy; logs how far the rollout's own are from them."""
    out = []
    for s in groups:
        traj = s.trajectory
        lp = torch.zeros_like(traj.log_probs)
        for start in range(0, traj.group_size, w.config.train.micro_batch_size):
            samples = list(range(start, start + w.config.train.micro_batch_size))
            scored = w.policy.score(traj, range(traj.num_inference_steps), samples,
                                    flow_grpo_compat=w.config.train.flow_grpo_compat)
            lp[samples] = torch.stack([o.log_prob.float().cpu() for o in scored], dim=1)  # [mb, T]
        mismatch.add({"rollout/logprob_mismatch_max": float((lp - traj.log_probs).abs().max())})
        out.append(lp)
    return out


def _collect_on_policy(w: Worker, requests: list[GenerationRequest]) -> tuple[list[ScoredGroup], int]:
    """The scored groups, every one sampled with the adapter the replicas were last given. Each request names that
    version and a replica serving another loads it from the adapter store first; should a group still come from
    another version (the store itself was restarted), it is regenerated after re-publishing."""
    expected = w.state.adapter_version  # what the requests ask for
    groups = w.aio.run(w.client.collect(requests))
    stale = [k for k, s in enumerate(groups) if s.trajectory.lora_version != expected]
    if stale:
        w.aio.run(w.client.publish(w.adapter))  # a no-op on replicas already serving it
        again = w.aio.run(w.client.collect([requests[k] for k in stale]))
        for k, s in zip(stale, again, strict=True):
            if s.trajectory.lora_version != expected:
                raise RuntimeError(f"group {requests[k].group_id} came from adapter version "
                                   f"{s.trajectory.lora_version} after re-publishing version {expected}")
            groups[k] = s
    return groups, len(stale)


def _gather_rewards(groups: list[ScoredGroup]) -> dict:
    """{global group index: RewardScores} of every worker's groups."""
    mine = {s.trajectory.group_id: s.rewards for s in groups}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return {g: r for part in everyone for g, r in part.items()}


def _reward_metrics(rewards: dict) -> dict[str, float]:
    total = np.array([r.total for r in rewards.values()])
    out = {"reward/mean": float(total.mean()), "reward/std": float(total.std()),
           "reward/min": float(total.min()), "reward/max": float(total.max())}
    for name in next(iter(rewards.values())).components:
        out[f"reward/{name}/mean"] = float(np.mean([r.components[name] for r in rewards.values()]))
    return out


def _extreme(key: str) -> str | None:
    """Which extreme a metric keeps ("max" for `..._max`, "min" for `..._min`), None for a mean."""
    return key.rsplit("_", 1)[-1] if key.endswith(("_max", "_min")) else None


class Stats:
    """Weighted means of metrics; keys ending in `_max`/`_min` keep the extreme instead (`_extreme`)."""

    def __init__(self):
        self.sums, self.weights, self.extremes = defaultdict(float), defaultdict(float), {}

    def add(self, metrics: dict[str, float], weight: float = 1.0) -> None:
        for key, value in metrics.items():
            kind = _extreme(key)
            if kind == "max":
                self.extremes[key] = max(self.extremes.get(key, -math.inf), value)
            elif kind == "min":
                self.extremes[key] = min(self.extremes.get(key, math.inf), value)
            else:
                self.sums[key] += weight * value
                self.weights[key] += weight

    def result(self) -> dict[str, float]:
        return {**{k: self.sums[k] / self.weights[k] for k in self.sums}, **self.extremes}


def _reduce_over_workers(metrics: dict[str, float], world: int) -> dict[str, float]:
    """Means over workers (each worker has the same number of terms), max/min for `_max`/`_min` keys."""
    out = {}
    for kind, op in [("max", dist.ReduceOp.MAX), ("min", dist.ReduceOp.MIN), (None, dist.ReduceOp.SUM)]:
        chosen = sorted(k for k in metrics if _extreme(k) == kind)  # the same keys in the same order on every rank
        if not chosen:
            continue
        values = torch.tensor([metrics[k] for k in chosen], dtype=torch.float64)
        dist.all_reduce(values, op=op)
        if kind is None:
            values /= world
        out.update(zip(chosen, values.tolist(), strict=True))
    return out


def _log_images_now(cfg: RunConfig, step: int) -> bool:
    every = cfg.logging.image_every
    return step + 1 == cfg.train.num_steps or (every > 0 and (step + 1) % every == 0) or step == 0


def _checkpoint_now(cfg: RunConfig, step: int) -> bool:
    every = cfg.train.checkpoint_every
    return step + 1 == cfg.train.num_steps or (every > 0 and (step + 1) % every == 0)


def _report(w: Worker, step: int, metrics: dict[str, float]) -> None:
    """Log (rank 0) and report the step to Ray Train, with a checkpoint when one is due (every rank writes its
    part into a folder of the same name; Ray Train merges them into `<run_dir>/checkpoints/`)."""
    if w.rank == 0:
        w.log.log(step + 1, metrics)
        w.ray_metrics.record(images=int(metrics["rollout/images"]), reward_mean=metrics["reward/mean"],
                             adapter_version=w.adapter.version, step_seconds=metrics["timing/step_s"])
        w.progress.step_done(step, metrics)
    if not _checkpoint_now(w.config, step):
        ray.train.report(metrics)
        return
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint.save(tmp, policy=w.policy, optimizer=w.optimizer, state=w.state, rank=w.rank,
                        adapter=w.adapter.tensors)  # gathered for publication already
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(tmp),
                         checkpoint_dir_name=f"checkpoint_step_{step + 1:06d}")


class Progress:
    """One line per step on the driver's console (Ray forwards worker stdout): the numbers a user watches."""

    def __init__(self, first: int, total: int):
        self.first, self.total, self.started = first, total, time.perf_counter()

    def step_done(self, step: int, m: dict[str, float]) -> None:
        done = step + 1 - self.first
        eta = (time.perf_counter() - self.started) / done * (self.total - step - 1)
        print(f"[flowgrpo] step {step + 1}/{self.total}  reward {m['reward/mean']:+.4f}  "
              f"loss {m['actor/loss']:+.2e}  |ratio-1| first pass {m['actor/ratio_dev_first_pass_max']:.1e}  "
              f"logprob mismatch {m['rollout/logprob_mismatch_max']:.1e}  staleness {m['rollout/staleness_max']:.0f}"
              f"  {m['timing/step_s']:.1f}s/step  eta {eta:.0f}s",
              file=sys.__stdout__, flush=True)  # the real stdout: Ray Train's print patch would log it twice


def _setup(config: RunConfig, run_dir: Path, client: RolloutClient, aio: asyncio.Runner) -> Worker:
    quiet_this_process(config.logging.verbose)  # e.g. Serve's INFO line when this worker's handles connect
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    torch.set_num_threads(max(1, int(config.cluster.worker_num_cpus)))
    m, t = config.model, config.train
    restored = None
    ckpt = ray.train.get_checkpoint()  # set when this run is resumed (same run folder)
    if ckpt is not None:
        with ckpt.as_directory() as directory:
            restored = checkpoint.load(directory, rank=rank)
        if restored.rng is not None:
            torch.set_rng_state(restored.rng)
    device = ray.train.torch.get_device() if config.cluster.use_gpu else torch.device("cpu")
    policy = Policy.from_pretrained(
        Path(m.path).resolve(), lora_rank=m.lora_rank, lora_alpha=m.lora_alpha, target_modules=m.lora_target_modules,
        dtype=getattr(torch, m.dtype), device=device, seed=t.seed,
        adapter_tensors=restored.adapter if restored else None)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=t.learning_rate, weight_decay=t.weight_decay)
    state = checkpoint.TrainerState(seed=t.seed)
    adapter = None
    if restored is not None:
        checkpoint.restore_optimizer(policy, optimizer, restored.optimizer)
        state = restored.state
        adapter = policy.export_adapter(version=state.adapter_version) if state.adapter_version > 0 else None
    worker = Worker(config=config, rank=rank, world=world, policy=policy, optimizer=optimizer,
                    client=client, aio=aio, prompts=load_prompts(config.data.prompts),
                    state=state, adapter=adapter)
    if rank == 0:
        # the replicas serve exactly this run's policy: the base model, or the resumed adapter (reset first: a
        # replica may serve an adapter of the same version number from an earlier run, or from before a restart)
        aio.run(worker.client.publish(None))
        if adapter is not None:
            aio.run(worker.client.publish(adapter))
        if restored is not None:
            print(f"[flowgrpo] continuing from the checkpoint of step {state.step}", file=sys.__stdout__, flush=True)
        worker.log = run_metrics.RunLog(run_dir)
        worker.ray_metrics = run_metrics.RayMetrics(run_dir.name)
        worker.progress = Progress(first=state.step, total=t.num_steps)
    dist.barrier()
    return worker
