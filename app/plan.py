"""How many GPUs generate and how many train: the placement planner behind `python -m jobs.plan`.

A step of `G` groups of `n` images is two kinds of GPU work: the rollout (a replica generates its groups one after
another) and the update (each FSDP2 rank trains `G / W` groups). From what one GPU does per image on each side
(`Rates`: measured by a run's first steps or by the two benches), the planner predicts a step for every placement
of `N` GPUs and picks the one with the most images per second per GPU:

- **split**: `R` replicas and `W` ranks on their own GPUs (`R + W = N`);
- **shared**: a replica and a rank on each GPU (`R = W = N`, half a GPU each); both halves must fit one GPU's
  memory, and when they run at once they share its throughput (`efficiency`: the share of the two halves' work
  alone that one GPU gets done when both run on it; 1: no loss).

With `k = train.max_staleness` >= 1 the sides work beside each other and the slower one sets the step; on-policy
(k = 0) they take turns:

    rollout = ceil(G / R) · n · r          train = (G / W) · n · t
    k >= 1, split:   step = max(rollout, train) + overhead
    k >= 1, shared:  step = max(rollout, train, (rollout + train) / efficiency) + overhead
    k  = 0:          step = rollout + reward_tail + train + overhead

r: a replica's seconds per image, t: a rank's seconds per image (the train phase times the ranks, over the images),
overhead: publish and bookkeeping per step, reward_tail: the reward still running after the last group.

FSDP2 gathers each block's frozen base from every rank at each pass, (W - 1) / W of the weights a rank: a rank's
seconds per image grow with the ranks as

    t(W) = t(1) · (1 + c · (W - 1) / W)

with `c` (`Rates.rank_overhead`) fitted from the trainer bench at two rank counts (`rank_overhead`; 0: perfect
scaling). On 2x H200 two ranks cost 1.12x one rank per image (1.02x keeping each block's gather for its backward),
and the loop on 4 GPUs matched it (docs/perf/scale/). Pure arithmetic: no Ray, no config objects.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from app.flops import PEAK_BF16_FLOPS

PEAK_TFLOPS = PEAK_BF16_FLOPS / 1e12  # the MFU denominator of app/metrics.py


@dataclass(frozen=True)
class Rates:
    """What the recipe costs per image, as measured (seconds of one process holding its GPU(s))."""

    rollout_s: float  # a rollout replica's engine seconds per image
    train_s: float  # a trainer rank's seconds per image (train phase x ranks / images)
    overhead_s: float = 0.0  # per step: publish, the wait for the last publication, bookkeeping
    reward_tail_s: float = 0.0  # per on-policy step: the reward after the last group was generated
    useful_tflop: float = 0.0  # per image (app/flops.py), for the MFU column; 0: unknown
    reward_s: float = 0.0  # a reward replica's seconds per image (its own scoring time); 0: unknown
    rollout_gib: float | None = None  # peak GPU memory of a replica
    trainer_gib: float | None = None  # peak GPU memory of a rank, at `ranks` ranks
    ranks: int = 1  # FSDP2 ranks of the measurement (the trainer's memory shrinks with more)
    kept_gathers: bool = False  # measured with train.reshard_after_forward=false (each block's gather kept)
    shared: bool = False  # measured with both halves on the same GPUs (pipelined: their contention is in the rates)
    rank_overhead: float = 0.0  # c of t(W) = t(1)(1 + c(W - 1)/W): FSDP2's gathers (module docstring)
    source: str = ""

    def __post_init__(self):
        if not (self.rollout_s > 0 and self.train_s > 0):
            raise ValueError(f"rates must be positive: rollout {self.rollout_s} s/image, train {self.train_s} s/image")
        if self.rank_overhead < 0:
            raise ValueError(f"rank overhead {self.rank_overhead} must be >= 0 (more ranks cost no less per image)")

    def train_s_at(self, ranks: int) -> float:
        """A rank's seconds per image with `ranks` FSDP2 ranks, from the `self.ranks` it was measured at."""
        def growth(w: int) -> float:
            return 1.0 + self.rank_overhead * (w - 1) / w

        return self.train_s / growth(self.ranks) * growth(ranks)


@dataclass(frozen=True)
class Placement:
    kind: str  # "split" or "shared"
    replicas: int
    ranks: int
    staleness: int  # train.max_staleness

    @property
    def gpus(self) -> int:
        return self.replicas if self.kind == "shared" else self.replicas + self.ranks

    def overrides(self) -> list[str]:
        """The run config's keys for this placement."""
        # shared: a replica takes more than half a GPU, so that Ray (best fit) puts one on each GPU, and a rank the
        # rest (jobs.train places the replicas first); Ray's fractions reserve nothing of the memory itself
        replica, rank = (0.6, 0.4) if self.kind == "shared" else (1, 1)
        return [f"rollout.num_replicas={self.replicas}", f"rollout.replica_num_gpus={replica}",
                f"cluster.num_workers={self.ranks}", f"cluster.worker_num_gpus={rank}",
                f"train.max_staleness={self.staleness}"]

    def describe(self) -> str:
        if self.kind == "shared":
            return f"shared: {self.replicas} GPU{'s' * (self.replicas > 1)}, each 1 replica + 1 rank"
        return f"split: {self.replicas} replica{'s' * (self.replicas > 1)} + {self.ranks} rank{'s' * (self.ranks > 1)}"


@dataclass(frozen=True)
class Prediction:
    placement: Placement
    step_s: float
    images_per_s_per_gpu: float
    mfu: float  # 0 when the rates carry no FLOPs
    rollout_busy: float  # shares of the step each side computes
    trainer_busy: float
    fits: bool | None  # memory (None: unknown)
    why_not: str = ""  # when it does not fit or cannot run


def trainer_gib(rates: Rates, ranks: int, weights_gib: float | None, kept_gathers: bool = False) -> float | None:
    """A rank's peak memory at `ranks` ranks: the measured peak with the frozen weights it holds resized (the rest,
    LoRA state and activations, does not shrink with more ranks). A rank holds its shard, and where each block keeps
    its gather for the backward (`kept_gathers`, several ranks) every block's whole weights too by the end of the
    forward: 40.0 GiB a rank on 2x H200 resharding, 74.5 keeping (38 GiB of weights). Unknown weights: the
    measured peak."""
    if rates.trainer_gib is None:
        return None
    if not weights_gib:
        return rates.trainer_gib

    def held(w: int, kept: bool) -> float:
        return weights_gib / w + (weights_gib if kept and w > 1 else 0.0)

    return rates.trainer_gib - held(rates.ranks, rates.kept_gathers) + held(ranks, kept_gathers)


def predict(rates: Rates, placement: Placement, *, groups: int, group_size: int, gpu_gib: float | None = None,
            weights_gib: float | None = None, efficiency: float = 0.9, kept_gathers: bool = False) -> Prediction:
    """The step of `groups` groups of `group_size` images under `placement` (module docstring); kept_gathers: the
    recipe sets train.reshard_after_forward=false (memory: `trainer_gib`)."""
    if not 0 < efficiency <= 1:
        raise ValueError(f"shared-GPU efficiency {efficiency} must be in (0, 1]")
    shared = placement.kind == "shared"
    rollout = math.ceil(groups / placement.replicas) * group_size * rates.rollout_s
    train = groups / placement.ranks * group_size * rates.train_s_at(placement.ranks)
    if placement.staleness >= 1:
        busy = max(rollout, train, (rollout + train) / efficiency if shared else 0.0)
        step = busy + rates.overhead_s
    else:
        step = rollout + rates.reward_tail_s + train + rates.overhead_s
    images = groups * group_size
    per_gpu = images / step / placement.gpus
    mfu = rates.useful_tflop * per_gpu / PEAK_TFLOPS
    fits, why = None, ""
    if groups % placement.ranks:
        fits, why = False, f"{groups} groups do not divide over {placement.ranks} ranks (train.groups_per_step)"
    elif gpu_gib is not None and rates.rollout_gib is not None and rates.trainer_gib is not None:
        rank_gib = trainer_gib(rates, placement.ranks, weights_gib, kept_gathers)
        need = rates.rollout_gib + rank_gib if shared else max(rates.rollout_gib, rank_gib)
        fits = need <= gpu_gib
        if not fits:
            what = "replica + rank" if shared else ("a replica" if rates.rollout_gib >= rank_gib else "a rank")
            why = f"{what} need{'s' * (not shared)} {need:.0f} GiB of a {gpu_gib:.0f} GiB GPU"
    return Prediction(placement, step, per_gpu, mfu, min(1.0, rollout / step), min(1.0, train / step), fits, why)


def reward_replicas(rates: Rates, prediction: Prediction, *, groups: int, group_size: int,
                    headroom: float = 1.25) -> int | None:
    """Reward replicas that score a step's images within the predicted step with `headroom` to spare (a group is
    scored as it arrives, so a reward that keeps up adds only the last group's scoring to a step); None when the
    rates carry no reward seconds."""
    if rates.reward_s <= 0:
        return None
    return max(1, math.ceil(groups * group_size * rates.reward_s * headroom / prediction.step_s))


def placements(gpus: int, staleness: int) -> list[Placement]:
    """Every split of `gpus` into replicas and ranks, and the shared placement."""
    if gpus < 1:
        raise ValueError(f"--gpus {gpus}: at least one GPU")
    out = [Placement("split", gpus - w, w, staleness) for w in range(1, gpus)]
    return out + [Placement("shared", gpus, gpus, staleness)]


def plan(rates: Rates, *, gpus: int, groups: int, group_size: int, staleness: int, gpu_gib: float | None = None,
         weights_gib: float | None = None, efficiency: float = 0.9, kept_gathers: bool = False) -> list[Prediction]:
    """Every placement of `gpus`, best first: those that can run by images per second per GPU, then the rest."""
    out = [predict(rates, p, groups=groups, group_size=group_size, gpu_gib=gpu_gib, weights_gib=weights_gib,
                   efficiency=efficiency, kept_gathers=kept_gathers) for p in placements(gpus, staleness)]
    return sorted(out, key=lambda p: (p.fits is False, -p.images_per_s_per_gpu))


# ---- rates from measurements ----------------------------------------------------------------------------------

STEADY_FROM = 2  # the first step compiles and warms up


def rates_from_metrics(rows: list[dict], *, replicas: int, ranks: int, shared: bool, kept_gathers: bool = False,
                       source: str = "") -> Rates:
    """Rates from a run's `metrics.jsonl` rows (its steps after the first; medians), for the run's placement:
    `replicas` rollout replicas and `ranks` FSDP2 ranks, `shared` when both halves held the same GPUs. A replica's
    seconds are the engines' own (`perf/rollout_busy_s`; older runs: the busy share times the replicas and the
    step), so a pipelined run measures the rollout even where the trainer bound its steps."""
    steady = [r for r in rows if r.get("step", 0) >= STEADY_FROM] or rows
    need = ["rollout/images", "timing/step_s", "timing/train_s"]
    missing = [k for k in need if not all(k in r for r in steady)]
    if not steady or missing:
        raise ValueError(f"no steps with {missing or need} in the metrics: not a jobs.train metrics.jsonl")

    def med(f) -> float:
        return statistics.median(f(r) for r in steady)

    def rollout_busy(r: dict) -> float:
        if "perf/rollout_busy_s" in r:
            return r["perf/rollout_busy_s"]
        return r.get("perf/rollout_busy_share", 0.0) * max(1, replicas) * r["timing/step_s"]

    def images(r: dict) -> float:
        return r["rollout/images"]

    rollout = med(lambda r: rollout_busy(r) / images(r))
    if rollout <= 0:
        raise ValueError("the metrics hold no rollout seconds (perf/rollout_busy_s or perf/rollout_busy_share)")
    peaks = {k: max((r[k] for r in rows if k in r), default=None)
             for k in ("memory/rollout_peak_gib_max", "memory/trainer_peak_gib_max")}
    return Rates(
        rollout_s=rollout,
        train_s=med(lambda r: (r["timing/train_s"] + r.get("timing/recompute_s", 0.0)) * ranks / images(r)),
        overhead_s=med(lambda r: r.get("timing/publish_s", 0.0) + r.get("timing/publish_wait_s", 0.0)
                       + r.get("timing/other_s", 0.0)),
        reward_tail_s=med(lambda r: r.get("timing/reward_wait_s_max", 0.0)),
        useful_tflop=med(lambda r: r.get("perf/useful_tflop", 0.0) / images(r)),
        reward_s=med(lambda r: r.get("perf/reward_busy_s", 0.0) / images(r)),
        rollout_gib=peaks["memory/rollout_peak_gib_max"] or None,
        trainer_gib=peaks["memory/trainer_peak_gib_max"] or None,
        ranks=ranks, shared=shared, kept_gathers=kept_gathers, source=source or f"{len(steady)} steps of a run")


def rates_from_benches(rollout: dict, train: dict, *, trained_steps: int, source: str = "") -> Rates:
    """Rates from one JSON line of `jobs.bench_rollout` (its batched images per second) and one of
    `jobs.bench_train_step` (ms per image per trained step), for a recipe training `trained_steps` steps of each
    image. Benches time the two sides alone: no publish and no reward in the rates. The trainer bench's figures are
    its ranks' together (`world_size`): a rank's seconds per image are its wall time per image times the ranks."""
    if "batched_images_per_s" not in rollout or "ms_per_image_step" not in train:
        raise ValueError("expected a jobs.bench_rollout line (batched_images_per_s) and a jobs.bench_train_step "
                         "line (ms_per_image_step)")
    img_s, wall_s = rollout["batched_images_per_s"], train["ms_per_image_step"] / 1000 * trained_steps
    tflop = rollout.get("batched_tflops", 0.0) / img_s + train.get("useful_tflops", 0.0) * wall_s
    ranks = int(train.get("world_size", 1))
    return Rates(rollout_s=1.0 / img_s, train_s=wall_s * ranks, useful_tflop=tflop,
                 trainer_gib=train.get("gpu_peak_gib"), ranks=ranks,
                 kept_gathers=train.get("reshard_after_forward") is False and ranks > 1, source=source or "the benches")


def rank_overhead(bench_lines: list[dict]) -> tuple[float, str]:
    """(c, what it came from): the FSDP2 term of the module docstring, fitted from `jobs.bench_train_step` lines of
    one recipe at two or more world sizes (the last line of each size; the smallest and the largest size fit it).
    Their `ms_per_image_step` is the trainer's wall time, so a rank's cost per image is it times the ranks."""
    by_ranks: dict[int, dict] = {}
    for line in bench_lines:
        if "ms_per_image_step" not in line or "world_size" not in line:
            raise ValueError("expected jobs.bench_train_step lines (world_size, ms_per_image_step)")
        by_ranks[int(line["world_size"])] = line
    if len(by_ranks) < 2:
        raise ValueError(f"the trainer bench at one world size only ({', '.join(map(str, by_ranks))}): give its "
                         f"lines at two rank counts (torchrun --nproc_per_node=N -m jobs.bench_train_step)")
    low, high = min(by_ranks), max(by_ranks)
    keys = ("layers", "size", "micro_batch_size", "gradient_checkpointing", "activation_memory_budget")
    differ = [k for k in keys if by_ranks[low].get(k) != by_ranks[high].get(k)]
    if differ:
        raise ValueError(f"the bench lines at {low} and {high} ranks measure different recipes ({', '.join(differ)})")
    ratio = (by_ranks[high]["ms_per_image_step"] * high) / (by_ranks[low]["ms_per_image_step"] * low)

    def share(w: int) -> float:  # of the weights a rank gathers
        return (w - 1) / w

    denominator = share(high) - ratio * share(low)
    if denominator <= 0:
        raise ValueError(f"{high} ranks cost {ratio:.2f}x {low} per image: more than gathering the weights explains "
                         f"(t(W) = t(1)(1 + c(W - 1)/W)); give the bench at 1 rank and at more")
    c = max(0.0, (ratio - 1) / denominator)
    return c, f"{high} ranks cost {ratio:.3f}x {low} per image"
