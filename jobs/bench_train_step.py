"""The trainer's update on the real transformer under FSDP2: milliseconds per image per trained step, and its MFU.

    python -m jobs.bench_train_step --config configs/qwen_image_ocr_2gpu.yaml model.path=DIR [--groups 2]
    python -m jobs.bench_train_step --config configs/sd35m_ocr.yaml model.path=DIR data.prompts=ocr_tiny
    python -m jobs.bench_train_step --config configs/bagel_ocr.yaml model.path=DIR   # text-to-image groups

One process, one rank (a world of one: FSDP2 wraps the LoRA as the Ray Train worker does, the frozen base left as it
is; `--shard-frozen`: FSDP2 manages the base too, as it does with several ranks), or several under torchrun
(`torchrun --nproc_per_node=2 -m jobs.bench_train_step ...`: the base sharded over the ranks, `--groups` groups on
each, MFU over all their GPUs; `train.reshard_after_forward` is FSDP2's choice there), the run config's
recipe: LoRA rank and targets, micro-batch, CFG, β·KL, gradient checkpointing. The batch is `--groups` groups of
`rollout.group_size` sampled images in shape (the family's `shaped_trajectory`: random latents and prompt states,
the cost does not depend on the values; `rollout.sde_window` places each group's window, whose steps are the ones
trained), with old log-probs scored by the policy before each pass (or, with `train.old_logprob=trainer`, by the pass
itself), so the first pass's ratios are 1 as in training: `ratio_dev_first_pass_max` says how exactly.
`model.compile.enabled=true` compiles the blocks (the warm-up pass then includes compilation: `warmup_s`;
`compile_frames_timed` counts compilations during the timed passes, 0 in steady state). Timed: one
`app.train.update.train_pass` (forward, backward, clipping, optimizer step) after a warm-up pass; the figure is the
median of --repeats passes (`--profile FILE`: one micro-batch of one trained step under the torch profiler, its GPU
time by kind of kernel and where the GPU waited on the host (`gpu_idle_by_host_op`) written to FILE as JSON).
Useful FLOPs (app/flops.py): forward + input-gradient backward of both CFG branches, plus the reference forward
when β > 0; gradient checkpointing's recomputation is not counted. One JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from app.algo.timesteps import trained_steps
from app.config import load
from app.flops import group_flops, mfu
from app.metrics import Stats
from app.models.attention import sdpa_kernels
from app.models.compile import cache_counts, compile_counts, compile_seconds, skip_guard_evaluation, trainer_mode
from app.train.policy import Policy
from app.train.update import make_optimizer, recompute_log_probs, train_pass
from app.types import Trajectory
from jobs.report import emit_json_line, profiled
from jobs.world import init_world


def synthetic_group(config, family, denoiser_config, group: int, seed: int) -> Trajectory:
    """A group shaped as the rollout would return it (CPU tensors), random values, its SDE window placed as the run
    config places group `group`'s at step 0."""
    rollout, steps = config.rollout, config.rollout.num_inference_steps
    if not hasattr(family, "shaped_trajectory"):
        raise SystemExit(f"jobs.bench_train_step: model.family={family.name} has no shaped_trajectory to bench on")
    window = rollout.sde_window.window(steps, seed=config.train.seed, group=group, step=0)
    request = rollout.request(f"group {group}", seed=group, group_id=group, sde_window=window)
    return family.shaped_trajectory(config.model.path, request, denoiser_config,
                                    torch.Generator().manual_seed(seed + group))


def bench(config, groups: int, repeats: int, profile: str | None = None, shard_frozen: bool = False) -> dict | None:
    """The result on rank 0 (None on the other ranks)."""
    cuda = torch.cuda.is_available()
    rank, world, device = init_world()
    model, rollout, train = config.model, config.rollout, config.train
    policy = Policy.from_pretrained(model.path, lora_rank=model.lora_rank, lora_alpha=model.lora_alpha,
                                    target_modules=model.lora_targets, family=str(model.family),
                                    dtype=getattr(torch, model.dtype),
                                    device=device, seed=train.seed, shard=True, shard_frozen=shard_frozen or None,
                                    gradient_checkpointing=train.gradient_checkpointing, compile=model.compile,
                                    activation_memory_budget=train.activation_memory_budget,
                                    reshard_after_forward=train.reshard_after_forward,
                                    attention_kernels=model.attention_kernels)
    optimizer = make_optimizer(policy, train)
    shape = policy.transformer.config
    batch = [synthetic_group(config, policy.family, shape, g, train.seed)
             for g in range(rank * groups, (rank + 1) * groups)]  # this rank's groups
    advantages = [torch.randn(t.group_size, generator=torch.Generator().manual_seed(g)) for g, t in enumerate(batch)]
    stats = Stats()

    def old_log_probs(step: int) -> list[torch.Tensor]:
        """Old log-probs at the steps pass `step` trains, of the adapter as the pass finds it (the pass before
        updated it), so that its first ratios are 1 as in training; old_logprob=trainer: the pass scores its own."""
        if train.old_logprob == "trainer":
            return [t.log_probs for t in batch]
        return recompute_log_probs(policy, train, batch, Stats(), step=step)

    def one_pass(step: int) -> float:
        """The pass's seconds on the slowest rank (its old log-probs scored before the clock starts)."""
        old = old_log_probs(step)
        if cuda:
            torch.cuda.synchronize()
        began = time.perf_counter()
        train_pass(policy, optimizer, train, step=step, epoch=0, trajectories=batch, advantages=advantages,
                   old=old, stats=stats, mismatch=Stats())
        if cuda:
            torch.cuda.synchronize()
        seconds = torch.tensor(time.perf_counter() - began, dtype=torch.float64, device=device)
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
        return seconds.item()

    warmup = one_pass(0)  # warm-up: allocator, kernels, optimizer state (and compilation)
    skip_guard_evaluation(model.compile)  # as a run after its first step (`guards: skip`)
    frames = compile_counts()["frames"]
    seconds = statistics.median(one_pass(step) for step in range(1, repeats + 1))
    frames = compile_counts()["frames"] - frames
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    if profile:  # one micro-batch of one trained step (forward, reference, backward): the repeating unit
        from app.train.update import step_loss

        traj, samples = batch[0], list(range(train.micro_batch_size))
        old = old_log_probs(0)[0][samples, 0]
        with profiled() as out:
            loss, _ = step_loss(policy, train, traj, 0, samples, advantages[0][samples], old)
            loss.backward()
        optimizer.zero_grad(set_to_none=True)
        if rank == 0:
            Path(profile).write_text(json.dumps({"micro_step_s": round(out["seconds"], 3), "images": len(samples),
                                                 "gpu_busy": out["gpu_busy"], **out["kernels"]}, indent=1))
    images = world * groups * rollout.group_size
    trained = len(trained_steps(batch[0].stochastic_steps, train.timestep_fraction, seed=train.seed, step=0,
                                group=0, epoch=0))  # per image, each pass: the window's steps, or a fraction of all
    flops = [group_flops(policy.family, shape, traj, trained_steps=trained, kl=train.kl_beta > 0, sampled=False)
             for traj in batch]  # the trainer's share only: this bench samples nothing
    useful = world * sum(f["train"] + f["reference"] for f in flops)  # every rank's groups are shaped alike
    ratio_dev = torch.tensor(stats.result().get("actor/ratio_dev_first_pass_max", 0.0), device=device)
    dist.all_reduce(ratio_dev, op=dist.ReduceOp.MAX)
    dist.destroy_process_group()
    if rank != 0:
        return None
    layers = len(policy.family.compiled_blocks(policy.transformer))  # the family's repeated blocks
    return {
        "bench": "train_step", "device": torch.cuda.get_device_name() if cuda else "cpu", "world_size": world,
        "layers": layers, "size": f"{rollout.width}x{rollout.height}", "images": images,
        "trained_steps": trained, "sde_window": rollout.sde_window.size, "cfg": rollout.guidance_scale,
        "kl_beta": train.kl_beta,
        "lora_rank": model.lora_rank, "lora_targets": len(model.lora_targets),
        "micro_batch_size": train.micro_batch_size, "gradient_checkpointing": train.gradient_checkpointing,
        "compiled": policy.compiled, "compile_mode": trainer_mode(model.compile.mode) if policy.compiled else None,
        "guards": str(model.compile.guards) if policy.compiled else None,
        "real_rope": bool(model.compile.real_rope) if policy.compiled else False,
        "shard_frozen": shard_frozen or world > 1,
        "activation_memory_budget": train.activation_memory_budget,
        "reshard_after_forward": train.reshard_after_forward, "old_logprob": str(train.old_logprob),
        "attention_kernels": sdpa_kernels(),
        "fused_optimizer": bool(optimizer.defaults.get("fused")),
        "warmup_s": round(warmup, 1), "compile_frames_timed": frames,
        "compile_cache": cache_counts(), "compile_seconds": compile_seconds(),
        "ratio_dev_first_pass_max": ratio_dev.item(),
        "pass_s": round(seconds, 3), "ms_per_image_step": round(1000 * seconds / (images * trained), 1),
        "useful_tflops": round(useful / seconds / 1e12, 1),
        "mfu": round(mfu(useful, seconds, world), 4) if cuda else None,
        "gpu_peak_gib": round(peak, 1) if cuda else None,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True)
    parser.add_argument("--groups", type=int, default=2, help="prompt groups in the timed batch")
    parser.add_argument("--repeats", type=int, default=3, help="timed passes (median reported)")
    parser.add_argument("--profile", help="write the GPU time by kind of kernel of one more pass to this JSON file")
    parser.add_argument("--shard-frozen", action="store_true",
                        help="FSDP2 manages the frozen base weights too (a world of one copies them at every "
                             "forward: the wrapping before 2026-11-26, to compare against)")
    parser.add_argument("overrides", nargs="*", help="key=value config overrides")
    args = parser.parse_intermixed_args(argv)  # key=value overrides before or after the options
    result = bench(load(args.config, args.overrides), args.groups, args.repeats, args.profile, args.shard_frozen)
    if result is not None:  # rank 0's
        emit_json_line(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
