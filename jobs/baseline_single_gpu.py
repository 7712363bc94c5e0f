"""The loop users would otherwise write: FlowGRPO in one process on one GPU, in the style of flow_grpo — generate,
score, train, with the project's own modules called directly and no Ray.

    python -m jobs.baseline_single_gpu --config configs/qwen_image_ocr_2gpu.yaml model.path=DIR [train.num_steps=5]

The same model, recipe, prompts and seeds as `jobs.train` with that config, but one transformer: the rollout samples
with the very module the optimizer updates (no adapter to publish), groups are generated one after another, and
the reward runs in this process between them. Prints one JSON line per step and a summary line (images/s, phase
times, whole-step MFU, peak GPU memory), so the Ray loop's overhead and the cost of separate rollout and training
GPUs are measured side by side (docs/performance.md).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from app.algo.advantages import step_advantages
from app.algo.timesteps import trained_steps
from app.config import load
from app.flops import group_flops, mfu
from app.metrics import PhaseTimer, Stats
from app.models.attention import leave_out_broken_backward
from app.prompt_sets import load_prompts
from app.rewards import build_reward
from app.rollout.diffusers_engine import DiffusersEngine
from app.train.policy import Policy
from app.train.prompts import group_request, step_prompts
from app.train.update import make_optimizer, train_pass
from deployments.reward import reward_options
from jobs.report import emit_json_line


def run(config, steps: int) -> dict:
    model, rollout, train = config.model, config.rollout, config.train
    engine = DiffusersEngine(model.path, dtype=model.dtype)
    engine.load()
    problem = leave_out_broken_backward(engine.device)  # as the trainer's Policy.from_pretrained does
    if problem is not None:
        print(f"[baseline] cuDNN's attention kernel left out: {problem}", file=sys.stderr)
    # the engine samples with the module the policy trains: the LoRA is live in both
    policy = Policy.with_lora(engine.pipe.transformer, lora_rank=model.lora_rank, lora_alpha=model.lora_alpha,
                              target_modules=model.lora_targets, seed=train.seed,
                              gradient_checkpointing=train.gradient_checkpointing)
    optimizer = make_optimizer(policy, train)
    reward = build_reward(config.reward.weights, reward_options(config.reward, ocr_threads=1))
    prompts = load_prompts(config.data.prompts)
    records = []
    for step in range(steps):
        timer = PhaseTimer()
        groups = step_prompts(prompts, step, train.groups_per_step, seed=train.seed, shuffle=config.data.shuffle)
        trajectories, totals, reward_s = [], {}, 0.0
        with timer("rollout"):
            for group, prompt in groups:
                traj = engine.sample(group_request(rollout, prompt, group, seed=train.seed, step=step))
                began = time.perf_counter()
                totals[group] = reward.score(traj.images, [traj.prompt] * traj.group_size).total
                reward_s += time.perf_counter() - began
                trajectories.append(traj)
        adv_of, _ = step_advantages(totals, std_mode=train.adv_std_mode, clip_max=train.adv_clip_max)
        stats, mismatch = Stats(), Stats()
        with timer("train"):
            for epoch in range(train.num_inner_epochs):
                grad_norm = train_pass(policy, optimizer, train, step=step, epoch=epoch, trajectories=trajectories,
                                       advantages=[adv_of[t.group_id] for t in trajectories],
                                       old=[t.log_probs for t in trajectories], stats=stats, mismatch=mismatch)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
        times = timer.metrics()
        images = sum(t.group_size for t in trajectories)
        # the Ray loop's count (app/train/loop.py): each group's trained steps (its SDE window's), every epoch
        trained = [train.num_inner_epochs * len(trained_steps(t.stochastic_steps, train.timestep_fraction,
                                                              seed=train.seed, step=step, group=t.group_id, epoch=0))
                   for t in trajectories]
        flops = sum(group_flops(policy.family, policy.transformer.config, t, trained_steps=k,
                                kl=train.kl_beta > 0)["total"] for t, k in zip(trajectories, trained, strict=True))
        record = {"step": step + 1, "reward_mean": statistics.fmean(x for v in totals.values() for x in v),
                  "grad_norm": grad_norm, "images": images, "trained_steps": max(trained), **times,
                  "timing/reward_s": reward_s,
                  "logprob_mismatch_max": mismatch.result().get("rollout/logprob_mismatch_max"),
                  "useful_tflop": flops / 1e12, "mfu": mfu(flops, times["timing/step_s"], 1)}
        if torch.cuda.is_available():
            record["gpu_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        emit_json_line({"baseline_step": record})
        records.append(record)
    measured = records[1:] or records  # the first step pays for warm-up
    step_s = statistics.fmean(r["timing/step_s"] for r in measured)
    return {
        "bench": "baseline_single_gpu", "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "steps": steps, "steps_averaged": len(measured), "images_per_step": records[-1]["images"],
        "size": f"{rollout.width}x{rollout.height}", "num_inference_steps": rollout.num_inference_steps,
        "cfg": rollout.guidance_scale, "trained_steps": records[-1]["trained_steps"], "lora_rank": model.lora_rank,
        "step_s": round(step_s, 2),
        **{k: round(statistics.fmean(r[f"timing/{k}_s"] for r in measured), 2) for k in ("rollout", "train")},
        "reward_s": round(statistics.fmean(r["timing/reward_s"] for r in measured), 2),
        "images_per_s_per_gpu": round(records[-1]["images"] / step_s, 3),
        "mfu": round(statistics.fmean(r["mfu"] for r in measured), 4),
        "gpu_peak_gib": round(max(r.get("gpu_peak_gib", 0.0) for r in records), 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True)
    parser.add_argument("overrides", nargs="*", help="key=value config overrides")
    args = parser.parse_intermixed_args(argv)  # key=value overrides before or after the options
    config = load(args.config, args.overrides)
    emit_json_line(run(config, config.train.num_steps))
    return 0


if __name__ == "__main__":
    sys.exit(main())
