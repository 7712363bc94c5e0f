"""Cheaper ODE steps (`rollout.ode_steps`) against the full computation, side by side on the same groups: the
rollout's speed, the reward's distribution, and the window's exactness.

    python -m jobs.bench_ode_steps --config configs/tiny_cpu.yaml rollout.engine=diffusers rollout.sde_window.size=2
    python -m jobs.bench_ode_steps --config configs/qwen_image_ocr_2gpu.yaml --groups 8 model.path=DIR \
        rollout.engine=diffusers --thresholds 0.05 0.1 --fp8
    (FP8's kernel: rollout.ode_steps.precision=fp8 rollout.ode_steps.fp8_scaling=tensorwise / fp8_fast_accum=true)

The run's prompts, groups and SDE windows (`group_request`, the run's seed, training step 0), sampled by the
in-process diffusers engine once at full cost (the reference), once per First Block Cache threshold and, with --fp8,
once with FP8 matmuls on the ODE steps, each setting's passes after one warm-up group of each. Prints one JSON line:
per setting the images/s (median of --repeats passes over every group), its effective TFLOP/s and MFU (the full
computation's FLOPs over the setting's time, as `jobs.bench_rollout` counts them) and a group's denoising seconds (the
steps alone, the last pass), the share of ODE forwards that reused the cache or one remaking of the FP8 weights, the
reward's mean and spread over every image, and against the reference: the speed-ups, the mean of the per-image reward
differences with its standard error (paired: same seeds), the seed-to-seed spread of the reference's rewards, the
learning signal's agreement (the run's group advantages from either setting's rewards: their correlation over every
image and the share whose sign agrees; 1.0 and 1.0: the same update, to first order), and whether the log-probs of
the groups whose window comes first (no cheaper step before it) are the reference's bit for bit.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from tqdm import tqdm

from app.algo.advantages import step_advantages
from app.config import load
from app.flops import group_flops, mfu
from app.models.family import get_family
from app.prompt_sets import load_prompts
from app.rewards import build_reward
from app.rollout.ode_steps import check_fp8_device
from app.train.prompts import group_request, step_prompts
from deployments.reward import reward_options
from deployments.rollout import make_engine
from jobs.report import emit_json_line


def _pass(engine, requests, setting: tuple[float | None, bool]) -> tuple[float, list]:
    engine.ode_cache_threshold, engine.ode_fp8 = setting
    try:
        began = time.perf_counter()
        trajs = [engine.sample(r) for r in requests]
        return time.perf_counter() - began, trajs
    finally:
        engine.ode_cache_threshold, engine.ode_fp8 = None, False


def _name(setting: tuple[float | None, bool]) -> str:
    threshold, fp8 = setting
    return "+".join(([f"first_block_{threshold}"] if threshold is not None else []) + (["fp8"] if fp8 else []))


def _denoise_s(trajs) -> float:
    """Seconds a group spent denoising (the steps, without the prompt's encoding and the VAE's decoding)."""
    return round(statistics.fmean(t.producer["phase_s"].get("denoise", 0.0) for t in trajs), 4)


def _rewards(reward, trajs) -> list[float]:
    return [x for t in trajs for x in reward.score(t.images, [t.prompt] * t.group_size).total]


def _quantize_s(engine) -> float:
    """Seconds one remaking of the FP8 weights takes (the weights here never change between groups: no group pays)."""
    fp8 = engine.fp8_step(engine.trained_module())
    fp8.quantize()
    return round(fp8.quantize_s, 4)


def _advantages(train, rewards: list[float], group_size: int) -> list[float]:
    """The run's advantages (`step_advantages`, the config's std mode and clip) of the groups' rewards in order."""
    groups = {g: rewards[g * group_size:(g + 1) * group_size] for g in range(len(rewards) // group_size)}
    adv, _ = step_advantages(groups, std_mode=train.adv_std_mode, clip_max=train.adv_clip_max)
    return [float(a) for g in sorted(adv) for a in adv[g]]


def _effective(flops: float, seconds: float) -> dict[str, float | None]:
    """The full computation's FLOPs over a pass's seconds: TFLOP/s (six significant digits: a tiny model's are
    small) and, on a GPU, the effective MFU against its bf16 peak (`app.flops.mfu`)."""
    return {"effective_tflops": float(f"{flops / seconds / 1e12:.6g}"),
            "effective_mfu": round(mfu(flops, seconds, 1), 4) if torch.cuda.is_available() else None}


def _agreement(a: list[float], b: list[float]) -> dict[str, float]:
    """Two settings' advantages on the same images: correlation and the share of equal signs (0 counts as a sign)."""
    corr = statistics.correlation(a, b) if statistics.pstdev(a) > 0 and statistics.pstdev(b) > 0 else float("nan")
    same = sum((x > 0) == (y > 0) and (x < 0) == (y < 0) for x, y in zip(a, b, strict=True)) / len(a)
    return {"advantage_corr": round(corr, 4), "advantage_sign_agreement": round(same, 4)}


def bench(config, groups: int, thresholds: list[float], fp8: bool, repeats: int) -> dict:
    ro = config.rollout
    if ro.sde_window.size == 0 or ro.sde_window.size >= ro.num_inference_steps:
        raise SystemExit("bench_ode_steps: every step is an SDE step: set rollout.sde_window.size (e.g. 2)")
    family = get_family(config.model.family)
    if config.model.build_tiny:
        family.build_tiny(config.model.path, seed=config.model.tiny_seed)
    engine = make_engine(config.model, config.rollout)
    if engine.kind != "diffusers":
        raise SystemExit(f"bench_ode_steps: the {engine.kind} engine has no cheaper ODE steps; use "
                         "rollout.engine=diffusers")
    if fp8:
        check_fp8_device(engine.device)
        engine.ode_fp8 = True  # its FP8 layers made at the load, before compilation, as a run's engine does
    engine.load()
    engine.ode_fp8 = False
    prompts = load_prompts(config.data.prompts)
    chosen = step_prompts(prompts, 0, groups, seed=config.train.seed, shuffle=config.data.shuffle)
    requests = [group_request(ro, prompt, group, seed=config.train.seed) for group, prompt in chosen]
    full_setting = (None, False)
    settings = [full_setting, *((t, False) for t in thresholds), *([(None, True)] if fp8 else [])]
    for setting in settings:  # warm-up: first-call allocations (and compilation) of each setting
        _pass(engine, requests[:1], setting)
    seconds: dict = {s: [] for s in settings}
    trajs: dict = {}
    for _ in tqdm(range(repeats), desc="passes", file=sys.stderr, leave=False):
        for setting in settings:  # interleaved: a drift of the machine touches every setting alike
            took, trajs[setting] = _pass(engine, requests, setting)
            seconds[setting].append(took)
    reward = build_reward(config.reward.weights, reward_options(config.reward, ocr_threads=1),
                          frames_every=config.reward.frames.every)
    scores = {s: _rewards(reward, trajs[s]) for s in settings}
    images = sum(r.n for r in requests)
    if len({r.n for r in requests}) != 1:
        raise SystemExit("bench_ode_steps: every group must have the same size (rollout.group_size)")
    advantages = {s: _advantages(config.train, scores[s], requests[0].n) for s in settings}
    full_s, full = statistics.median(seconds[full_setting]), scores[full_setting]
    # the full computation's useful FLOPs (every step's forward, every CFG branch), counted for every setting: a
    # cheaper step does the work it replaces, so a setting's effective MFU rises with its speed
    denoiser = family.denoiser_config(config.model.path)
    flops = sum(group_flops(family, denoiser, t, trained_steps=0, kl=False)["rollout"] for t in trajs[full_setting])
    # groups whose window comes first: no cheaper step before it, so its log-probs must be the reference's bit for
    # bit (after a cheaper step the window starts elsewhere; the trainer's recompute is exact there too: the tests)
    window_first = [i for i, r in enumerate(requests) if r.sde_window is not None and r.sde_window[0] == 0]
    result = {"bench": "ode_steps", "engine": engine.kind, "device": str(engine.device), "family": family.name,
              "groups": groups, "images": images, "steps": ro.num_inference_steps, "sde_window": ro.sde_window.size,
              "rollout_gflops_per_image": float(f"{flops / images / 1e9:.6g}"),
              "full": {"images_per_s": round(images / full_s, 4), **_effective(flops, full_s),
                       "denoise_s_per_group": _denoise_s(trajs[full_setting]), "reward_mean": statistics.fmean(full),
                       "reward_std": statistics.stdev(full) if len(full) > 1 else 0.0}}
    for setting in settings[1:]:
        got, took = scores[setting], statistics.median(seconds[setting])
        diffs = [a - b for a, b in zip(got, full, strict=True)]
        forwards = sum(t.producer.get("ode_forwards", 0) for t in trajs[setting])
        cached = sum(t.producer.get("ode_forwards_cached", 0) for t in trajs[setting])
        exact = all(torch.equal(trajs[setting][i].log_probs, trajs[full_setting][i].log_probs) for i in window_first)
        denoise = _denoise_s(trajs[setting])
        row = {"images_per_s": round(images / took, 4), **_effective(flops, took), "speedup": round(full_s / took, 3),
               "denoise_s_per_group": denoise,
               "denoise_speedup": round(result["full"]["denoise_s_per_group"] / denoise, 3) if denoise else None,
               "reward_mean": statistics.fmean(got), "reward_std": statistics.stdev(got) if len(got) > 1 else 0.0,
               "reward_shift": statistics.fmean(diffs),
               "reward_shift_se": statistics.stdev(diffs) / len(diffs) ** 0.5 if len(diffs) > 1 else 0.0,
               "reward_seed_std": result["full"]["reward_std"],
               **_agreement(advantages[full_setting], advantages[setting]),
               "window_first_groups": len(window_first), "window_first_logprobs_exact": exact}
        if setting[0] is not None:
            row["ode_forwards_cached_share"] = round(cached / forwards, 3) if forwards else 0.0
        if setting[1]:  # a run pays it at the first group after each change of the weights (a folded adapter)
            row["fp8_quantize_s"] = _quantize_s(engine)
            row["fp8_scaling"], row["fp8_fast_accum"] = engine.ode_fp8_scaling, engine.ode_fp8_fast_accum
        result[_name(setting)] = row
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--groups", type=int, default=8, help="prompt groups (8 groups of 8: 64 images)")
    parser.add_argument("--thresholds", type=float, nargs="*", default=[0.05],
                        help="First Block Cache thresholds to compare with the full computation (none: no cache)")
    parser.add_argument("--fp8", action="store_true", help="compare FP8 matmuls on the ODE steps too")
    parser.add_argument("--repeats", type=int, default=1, help="timed passes per setting (median reported)")
    parser.add_argument("overrides", nargs="*", help="key=value overrides of the config")
    args = parser.parse_args(argv)
    if any(t <= 0 for t in args.thresholds):
        parser.error("--thresholds must be > 0")
    config = load(args.config, args.overrides)
    if not args.thresholds and not args.fp8:
        parser.error("nothing to compare: give --thresholds or --fp8")
    emit_json_line(bench(config, args.groups, args.thresholds, args.fp8, args.repeats))
    return 0


if __name__ == "__main__":
    sys.exit(main())
