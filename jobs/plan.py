"""Choose how many GPUs generate and how many train, and whether the two halves share GPUs.

    python -m jobs.plan --config CONFIG --gpus N --metrics RUN/metrics.jsonl [key=value ...]
    python -m jobs.plan --config CONFIG --gpus N --bench-rollout ROLLOUT.jsonl --bench-train TRAIN.jsonl

From what each side costs per image, measured by a run of the same recipe (its steps after the first: any
placement, any GPU count; the run's own `config.yaml` beside its metrics says which) or by the two benches
(`jobs.bench_rollout`, `jobs.bench_train_step`, their last JSON line), it predicts every placement of N GPUs for
CONFIG's recipe (groups per step, group size, `train.max_staleness`) and prints them best first with the overrides
of the best (app/plan.py has the model). A placement must divide the step's groups over its ranks and fit the GPUs'
memory (`--gpu-gib`, default: this machine's first GPU; the shared placement holds a replica and a rank on each).
N can be any count, several nodes' GPUs included: a replica or a rank is one GPU, or half of one when shared.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

from app.algo.sde_window import stochastic_steps
from app.algo.timesteps import trained_steps
from app.config import ConfigError, load
from app.plan import Prediction, Rates, plan, rank_overhead, rates_from_benches, rates_from_metrics, reward_replicas


class PlanError(ValueError):
    """A missing or malformed input, said in one line."""


def read_jsonl(path: str, what: str) -> list[dict]:
    file = Path(path)
    if not file.is_file():
        raise PlanError(f"{what} {path}: no such file")
    rows = []
    for number, line in enumerate(file.read_text().splitlines(), start=1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise PlanError(f"{what} {path}: line {number} is not JSON ({e.msg})") from None
    if not rows:
        raise PlanError(f"{what} {path}: empty")
    return rows


def measured_rates(args, config) -> Rates:
    """The rates of --metrics (with the measured run's placement) or of the two benches."""
    if args.metrics:
        rows = read_jsonl(args.metrics, "--metrics")
        run_config = Path(args.metrics).with_name("config.yaml")
        run = load(str(run_config)) if run_config.is_file() else config  # the measured run's placement
        replicas, ranks = run.rollout.num_replicas, run.cluster.num_workers
        shared = run.rollout.replica_num_gpus < 1 and run.cluster.worker_num_gpus < 1
        where = f"{replicas} replica(s) + {ranks} rank(s){', sharing GPUs' if shared else ''}"
        source = f"{args.metrics} ({where}{'' if run_config.is_file() else ', as CONFIG'})"
        return rates_from_metrics(rows, replicas=replicas, ranks=ranks, shared=shared,
                                  kept_gathers=ranks > 1 and not run.train.reshard_after_forward, source=source)
    if not (args.bench_rollout and args.bench_train):
        raise PlanError("give the measured rates: --metrics RUN/metrics.jsonl, or --bench-rollout and --bench-train")
    rollout = read_jsonl(args.bench_rollout, "--bench-rollout")[-1]
    train = read_jsonl(args.bench_train, "--bench-train")[-1]
    return rates_from_benches(rollout, train, trained_steps=trained_steps_per_image(config),
                              source=f"{args.bench_rollout} and {args.bench_train}")


def with_rank_overhead(rates: Rates, paths: list[str] | None, config) -> Rates:
    """The rates with FSDP2's cost of more ranks (app/plan.py `rank_overhead`), fitted from the --bench-train-ranks
    lines of the recipe's `train.reshard_after_forward` (several ranks; it sets how often a block is gathered), at
    two or more world sizes. Lines of the recipe's activation memory (checkpointing, budget) are preferred; without
    them, those of another setting serve, and the source says so (the gathers are the same; the compute they add
    to differs). A file of every variant a lease ran can be given as it is."""
    if not paths:
        return rates
    train = config.train
    lines = [line for path in paths for line in read_jsonl(path, "--bench-train-ranks")
             if line.get("bench") == "train_step"]
    usable = [line for line in lines if line.get("world_size", 1) == 1
              or line.get("reshard_after_forward") == train.reshard_after_forward]

    def memory(line: dict) -> tuple:
        return line.get("gradient_checkpointing"), line.get("activation_memory_budget")

    groups: dict[tuple, list[dict]] = {}
    for line in usable:
        groups.setdefault(memory(line), []).append(line)
    fitting = {k: g for k, g in groups.items() if len({line.get("world_size") for line in g}) >= 2}
    if not fitting:
        raise PlanError(f"--bench-train-ranks: no two world sizes of the trainer bench with, on several ranks, "
                        f"train.reshard_after_forward={train.reshard_after_forward} ({len(lines)} bench lines)")
    mine = (train.gradient_checkpointing, train.activation_memory_budget)
    chosen = mine if mine in fitting else next(iter(fitting))
    c, why = rank_overhead(fitting[chosen])
    if chosen != mine:
        why += (f" (with gradient_checkpointing={chosen[0]}, activation_memory_budget={chosen[1]}: none at the "
                f"recipe's {mine[0]}, {mine[1]})")
    return replace(rates, rank_overhead=c, source=f"{rates.source}; FSDP2 from the trainer bench: {why}")


def trained_steps_per_image(config) -> int:
    """Denoising steps the recipe trains per image: `train.timestep_fraction` of its SDE window's steps, counted by
    the rule the trainer draws them with."""
    rollout = config.rollout
    window = rollout.sde_window.window(rollout.num_inference_steps, seed=0, group=0, step=0)
    return len(trained_steps(stochastic_steps(rollout.num_inference_steps, window), config.train.timestep_fraction,
                             seed=0, step=0, group=0, epoch=0))


def gpu_memory_gib(given: float | None) -> float | None:
    if given is not None:
        return given
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_properties(0).total_memory / 2**30
    except ImportError:
        pass
    return None


def weights_gib(config) -> float | None:
    """The denoiser's weights on disk (what FSDP2 shards over ranks), when the model folder is here."""
    folder = Path(config.model.path or "") / "transformer"
    files = list(folder.glob("*.safetensors")) if folder.is_dir() else []
    return sum(f.stat().st_size for f in files) / 2**30 if files else None


# What one GPU shared by a replica and a rank gets done of both halves' work alone, measured with the fast recipe:
# eager on one H200; compiled on 4x H200 with merged replicas (`q_shared4_mor1`, docs/perf/scale/lease5_4xh200/:
# its median step; the train phase took about twice its time alone). Not modelled: that run's first publication,
# 45 s once, while each replica copied its base weights to pinned host memory (`rollout.merged_base_on: auto` on a
# GPU a rank shares)
SHARED_EFFICIENCY = {"eager": 0.9, "compiled": 0.8}


def shared_efficiency(config) -> float:
    return SHARED_EFFICIENCY["compiled" if config.model.compile.enabled else "eager"]


def table(predictions: list[Prediction]) -> str:
    lines = [f"  {'placement':<40} {'s/step':>7} {'img/s/GPU':>10} {'MFU':>6}  busy rollout/trainer  memory"]
    for k, p in enumerate(predictions):
        mark = "*" if k == 0 and p.fits is not False else " "
        memory = {True: "fits", False: f"no: {p.why_not}", None: "not checked"}[p.fits]
        lines.append(f"{mark} {p.placement.describe():<40} {p.step_s:>7.1f} {p.images_per_s_per_gpu:>10.3f} "
                     f"{100 * p.mfu:>5.1f}%  {p.rollout_busy:>8.2f} / {p.trainer_busy:.2f}      {memory}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="the recipe to place (a run config)")
    parser.add_argument("--gpus", type=int, required=True, help="GPUs to place it on (all nodes together)")
    parser.add_argument("--metrics", help="metrics.jsonl of a run of the same recipe (its config.yaml beside it)")
    parser.add_argument("--bench-rollout", help="jobs.bench_rollout's JSON line(s), the last is used")
    parser.add_argument("--bench-train", help="jobs.bench_train_step's JSON line(s), the last is used")
    parser.add_argument("--bench-train-ranks", nargs="+", metavar="JSONL",
                        help="jobs.bench_train_step lines of the recipe at two or more world sizes (torchrun "
                             "--nproc_per_node=N): what more FSDP2 ranks cost per image (default: nothing)")
    parser.add_argument("--gpu-gib", type=float, help="memory of one GPU (default: this machine's first GPU)")
    parser.add_argument("--shared-efficiency", type=float, default=None,
                        help="the share of both halves' work alone that one shared GPU gets done while both run "
                             f"(default: {SHARED_EFFICIENCY['eager']} eager, one H200, the fast recipe; "
                             f"{SHARED_EFFICIENCY['compiled']} compiled, 4x H200, merged replicas)")
    parser.add_argument("--json", action="store_true", help="one JSON line per placement instead of the table")
    parser.add_argument("overrides", nargs="*", help="key=value overrides of CONFIG")
    args = parser.parse_intermixed_args(argv)
    try:
        if args.gpus < 1:
            raise PlanError(f"--gpus {args.gpus}: at least one GPU")
        config = load(args.config, args.overrides)
        rates = with_rank_overhead(measured_rates(args, config), args.bench_train_ranks, config)
        gib = gpu_memory_gib(args.gpu_gib)
        efficiency = shared_efficiency(config) if args.shared_efficiency is None else args.shared_efficiency
        groups, n = config.train.groups_per_step, config.rollout.group_size
        predictions = plan(rates, gpus=args.gpus, groups=groups, group_size=n, staleness=config.train.max_staleness,
                           gpu_gib=gib, weights_gib=weights_gib(config), efficiency=efficiency,
                           kept_gathers=not config.train.reshard_after_forward)
    except (PlanError, ConfigError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        for p in predictions:
            print(json.dumps({"placement": p.placement.describe(), "overrides": p.placement.overrides(),
                              "gpus": p.placement.gpus, "step_s": round(p.step_s, 3),
                              "images_per_s_per_gpu": round(p.images_per_s_per_gpu, 4), "mfu": round(p.mfu, 4),
                              "rollout_busy": round(p.rollout_busy, 3), "trainer_busy": round(p.trainer_busy, 3),
                              "fits": p.fits, "why_not": p.why_not}))
        return 0
    k = config.train.max_staleness
    print(f"jobs.plan: {args.gpus} GPU(s){f' of {gib:.0f} GiB' if gib else ' (memory not checked: --gpu-gib)'}, "
          f"{groups} groups of {n} a step, {'pipelined' if k else 'on-policy'} (train.max_staleness={k})")
    print(f"rates from {rates.source}: rollout {rates.rollout_s:.3f} s/image per replica, train {rates.train_s:.3f} "
          f"s/image per rank{f' at {rates.ranks}' if rates.rank_overhead else ''}, overhead {rates.overhead_s:.2f} "
          f"s/step{f', FSDP2 term c = {rates.rank_overhead:.3f}' if rates.rank_overhead else ''}")
    print(f"a shared GPU gets {efficiency:.2f} of both halves' work alone done (--shared-efficiency; "
          f"{'compiled' if config.model.compile.enabled else 'eager'} default {shared_efficiency(config)})")
    print(table(predictions))
    best = predictions[0]
    if best.fits is False:
        print(f"no placement of {args.gpus} GPU(s) can run this recipe: {best.why_not}")
        return 1
    print(f"choose {best.placement.describe()}: predicted {best.images_per_s_per_gpu:.3f} img/s/GPU")
    needed = reward_replicas(rates, best, groups=groups, group_size=n)
    if needed is not None:
        print(f"reward: {rates.reward_s:.3f} s/image per replica; {needed} replica(s) keep up with that step "
              f"(reward.num_replicas={config.reward.num_replicas})")
    chosen = best.placement.overrides()
    keys = {o.split("=", 1)[0] for o in chosen}
    kept = [o for o in args.overrides if o.split("=", 1)[0] not in keys]  # the placement's keys replace CONFIG's
    print(f"  python -m jobs.train --config {args.config} {' '.join(kept + chosen)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
