"""Rollout throughput of the engine `rollout.engine` names (vllm-omni, or diffusers on the GPU machine): batched
prompt groups vs per-sample requests, and what recording trajectories costs compared with the library's stock
sampling.

    python -m jobs.bench_rollout --config configs/tiny_cpu.yaml [--groups 8] [key=value ...]
    python -m jobs.bench_rollout --config configs/qwen_image_ocr_2gpu.yaml --groups 2 model.path=...

Prints one JSON line: images/s of the batched mode (one request of n images per group) and of the per-sample
mode (n requests of one image) at the same n, their ratio, and the overhead of the FlowGRPO pipeline (SDE step,
per-sample generators, latents/log-probs recorded) over stock generation (`generate_plain`). Each mode runs the
same prompts and seeds after a warm-up; the figure is the median of --repeats timed passes.
`model.compile.enabled=true` compiles the engine's blocks: the warm-up (`warmup_s`) then includes compilation,
and `compile_frames_timed` counts compilations during the timed batched passes (0 in steady state).

--adapter serves a random adapter of the run's LoRA shape (`model.lora_*`) from the warm-up on, as a run's replica
does after its first step, and after the timed passes swaps in a second one: `adapter_swap_s` is what a new version
costs the next group (with `rollout.merge_lora=true`: folding it into the weights).

With vllm-omni (its model in its own worker process) the adapter is made from the checkpoint's layer shapes
(`denoiser_skeleton`), and `adapter_load_s` (every engine) is what handing a new version to the engine takes.

--mismatch (an out-of-process engine: vllm-omni) scores the first group of the timed passes with the trainer's
code (the family's `score_trajectory`, eager, the run's dtype, micro-batches of `train.micro_batch_size`, the
adapter attached) once the engine has closed, in this process on its device: `logprob_mismatch_max` is the largest
|log-prob| gap over the group's stochastic steps, what `rollout/logprob_mismatch_max` logs in a run with
`train.old_logprob: recompute` (with `rollout`, the first pass's ratio is off by about that much).

--profile FILE writes one more group of an in-process engine under the torch profiler: GPU seconds by kind of
kernel, the top kernels, and the share of the group's wall time the GPU was busy (`gpu_busy`: well under 1, the
GPU waits on Python's launches, which CUDA graphs remove, or on synchronisations); on a GPU also its idle seconds
in gaps over 50 us and the host operations running in them (`gpu_idle_s`, `gpu_idle_by_host_op`).
"""

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from app.config import load
from app.flops import group_flops, mfu
from app.models.attention import sdpa_kernels
from app.models.compile import cache_counts, compile_counts
from app.models.family import get_family
from app.models.lora import attach_lora, random_lora
from app.types import LoraAdapter
from deployments.rollout import make_engine
from jobs.report import emit_json_line, profiled

PROMPTS = ['a sign that says "OPEN"', "a red cube on a blue table", "a photo of a cat", 'text reading "HELLO"']


async def _timed(label: str, run, requests, repeats: int) -> tuple[float, float, list]:
    """The median seconds of `repeats` passes over `requests`, and the last pass's seconds and results."""
    times = []
    for _ in tqdm(range(repeats), desc=label, file=sys.stderr, leave=False):
        start = time.perf_counter()
        results = [await run(r) for r in requests]
        times.append(time.perf_counter() - start)
    return statistics.median(times), times[-1], results


def _random_adapter(engine, family, model, version: int) -> LoraAdapter:
    """A random adapter of the run's LoRA shape for `engine`'s module (the module itself left as it is), or for the
    checkpoint's layers where the engine's model lives in another process."""
    if hasattr(engine, "trained_module"):
        module = engine.trained_module()
    else:  # the layers' shapes, in the dtype the run's trainer publishes in
        module = family.denoiser_skeleton(model.path).to(getattr(torch, str(model.dtype)))
    try:
        return random_lora(module, version=version, rank=model.lora_rank, target_modules=model.lora_targets,
                           seed=version, scale=0.1, alpha=model.lora_alpha)
    except ValueError as err:
        raise SystemExit(f"--adapter: {err} (model.lora_target_modules)") from None


def _trainer_mismatch(family, config, traj, adapter: LoraAdapter | None) -> dict:
    """How far the trainer's recompute of `traj`'s log-probs is from the engine's (module doc, --mismatch)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    denoiser = family.load_denoiser(config.model.path, dtype=getattr(torch, str(config.model.dtype)),
                                    device=device).eval()
    if adapter is not None:
        attach_lora(denoiser, adapter)
    steps, micro = traj.stochastic_steps, config.train.micro_batch_size
    gaps = torch.zeros(traj.group_size, len(steps))
    with torch.no_grad():
        for start in range(0, traj.group_size, micro):
            samples = list(range(start, min(start + micro, traj.group_size)))
            scored = family.score_trajectory(denoiser, traj, steps, samples)
            for k, (i, out) in enumerate(zip(steps, scored, strict=True)):
                gaps[samples, k] = (out.log_prob.float().cpu() - traj.log_probs[samples, i]).abs()
    del denoiser
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return {"logprob_mismatch_max": float(gaps.max()), "logprob_mismatch_mean": float(gaps.mean()),
            "mismatch_micro_batch": micro, "mismatch_adapter": adapter is not None}


async def _profile(engine, request, path: str) -> None:
    """One group under the profiler (the engine's kernels run in this process)."""
    with profiled() as out:
        await engine.generate(request)
    Path(path).write_text(json.dumps({"group_s": round(out["seconds"], 3), "images": request.n,
                                      "gpu_busy": out["gpu_busy"], **out["kernels"]}, indent=1))


async def bench(config, groups: int, repeats: int, batched_only: bool = False, adapter: bool = False,
                profile: str | None = None, mismatch: bool = False) -> dict:
    family = get_family(config.model.family)
    if config.model.build_tiny:
        family.build_tiny(config.model.path, seed=config.model.tiny_seed)
    engine = make_engine(config.model, config.rollout)
    if profile and not hasattr(engine, "trained_module"):
        raise SystemExit(f"--profile: the {engine.kind} engine's model is not in this process; use an in-process "
                         "engine (rollout.engine=diffusers, or bagel)")
    if mismatch and hasattr(engine, "trained_module"):
        raise SystemExit(f"--mismatch: the {engine.kind} engine runs the trainer's own code in this process (its "
                         "log-probs are the trainer's in a batch of the same size); use rollout.engine=vllm_omni")
    await engine.start()
    requests = [config.rollout.request(PROMPTS[i % len(PROMPTS)], seed=i) for i in range(groups)]
    ro = config.rollout
    images = groups * ro.group_size
    served = None
    if adapter:
        served = _random_adapter(engine, family, config.model, 1)
        await engine.load_lora(served)  # applied by the first group
    began = time.perf_counter()
    first = await engine.generate(requests[0])  # warm-up: first-call allocations (and compilation)
    for r in requests[1:]:  # every prompt once: its text length (a new shape for a compiled block)
        await engine.generate(r)
    warmup = time.perf_counter() - began
    frames = compile_counts()["frames"]
    batched, last, trajs = await _timed("batched", engine.generate, requests, repeats)
    phases: dict[str, float] = {}  # an in-process engine's encode / denoise / decode seconds, the last pass
    for traj in trajs:
        for phase, seconds in traj.producer.get("phase_s", {}).items():
            phases[phase] = phases.get(phase, 0.0) + seconds
    swap = load = None
    if adapter:  # the next version, as a run publishes it; a replica's next group pays for the swap
        second = _random_adapter(engine, family, config.model, 2)
        began = time.perf_counter()
        await engine.load_lora(second)
        load = time.perf_counter() - began
        swap = (await engine.generate(requests[0])).producer.get("adapter_swap_s")
    frames = compile_counts()["frames"] - frames  # the timed passes and a new version: 0 in steady state
    if profile:
        await _profile(engine, requests[0], profile)
    plain = per_sample = None
    if not batched_only:
        await engine.generate_plain(requests[0])
        plain, _, _ = await _timed("plain", engine.generate_plain, requests, repeats)
        engine.batched_groups = False
        await engine.generate(requests[0])
        per_sample, _, _ = await _timed("per-sample", engine.generate, requests, repeats)
    await engine.close()
    gap = _trainer_mismatch(family, config, trajs[0], served) if mismatch else {}
    # useful FLOPs of the batched mode: every denoising step's forward, both CFG branches
    denoiser = family.denoiser_config(config.model.path)
    flops = groups * group_flops(family, denoiser, first, trained_steps=0, kl=False)["rollout"]
    return {
        "bench": "rollout", "engine": engine.kind, "device": "cuda" if torch.cuda.is_available() else "cpu",
        "torch_threads": torch.get_num_threads(), "group_size": ro.group_size, "groups": groups,
        "size": f"{ro.width}x{ro.height}", "steps": ro.num_inference_steps, "cfg": ro.guidance_scale,
        **({"frames": ro.num_frames} if ro.num_frames else {}),  # videos: the row's cost depends on them
        "dtype": str(config.model.dtype), "compiled": engine.compiled,
        "compile_mode": str(config.model.compile.mode) if engine.compiled else None,
        "real_rope": bool(config.model.compile.real_rope) if engine.compiled else False,
        "adapter": adapter, "merge_lora": getattr(engine, "merged_base_on", None),
        "attention_kernels": sdpa_kernels() if hasattr(engine, "trained_module") else None,  # vllm-omni: its own
        "adapter_swap_s": round(swap, 5) if swap is not None else None,
        "adapter_load_s": round(load, 4) if load is not None else None,
        "warmup_s": round(warmup, 1), "compile_frames_timed": frames,
        "compile_cache": cache_counts(),
        # four decimals: a video group takes tens of seconds (0.1306 videos/s, not 0.13)
        "batched_images_per_s": round(images / batched, 4),
        "batched_s_per_group": round(batched / groups, 3),
        "batched_phase_share": {k: round(v / last, 3) for k, v in phases.items()},  # of the last pass's time
        **({} if batched_only else {
            "per_sample_images_per_s": round(images / per_sample, 4),
            "batched_over_per_sample": round(per_sample / batched, 2),
            "plain_images_per_s": round(images / plain, 4),
            "trajectory_overhead_pct": round(100 * (batched - plain) / plain, 1)}),
        "batched_tflops": round(flops / batched / 1e12, 1),
        "batched_mfu": round(mfu(flops, batched, 1), 4) if torch.cuda.is_available() else None,
        **gap,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True)
    parser.add_argument("--groups", type=int, default=8, help="prompt groups per timed pass")
    parser.add_argument("--repeats", type=int, default=3, help="timed passes per mode (median reported)")
    parser.add_argument("--batched-only", action="store_true",
                        help="time the batched mode only (no stock-pipeline or per-sample comparison)")
    parser.add_argument("--adapter", action="store_true",
                        help="serve a random adapter of the run's LoRA shape (and time the swap to a second one)")
    parser.add_argument("--mismatch", action="store_true",
                        help="the trainer's recompute of the first timed group's log-probs against the engine's "
                             "(an out-of-process engine; after it closed)")
    parser.add_argument("--profile", help="write the GPU time by kind of kernel of one more group to this JSON file")
    parser.add_argument("overrides", nargs="*", help="key=value config overrides")
    args = parser.parse_intermixed_args(argv)  # key=value overrides before or after the options
    config = load(args.config, args.overrides)
    result = asyncio.run(bench(config, args.groups, args.repeats, args.batched_only, args.adapter,
                                 args.profile, args.mismatch))
    emit_json_line(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
