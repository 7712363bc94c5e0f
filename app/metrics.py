"""Where a run's numbers go: tensorboard and a JSON-lines history (rank 0 only), and Ray metrics that the Ray
dashboard shows (exported through Ray's Prometheus endpoint; Grafana panels under the `ray_flowgrpo_` prefix)."""

from __future__ import annotations

import itertools
import json
import math
import sys
import time
from collections import defaultdict
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import numpy as np


class RunLog:
    """Rank 0's record of a run under `run_dir`: tensorboard events (`tensorboard/`), one JSON line per step
    (`metrics.jsonl`, what the reward curve is drawn from), image grids (`images/step_XXXXXX.png`), Ray metrics
    (tagged with the run folder's name) and the console's progress line."""

    def __init__(self, run_dir: str | Path, *, first_step: int, total_steps: int):
        from torch.utils.tensorboard import SummaryWriter

        self.dir = Path(run_dir)
        (self.dir / "images").mkdir(parents=True, exist_ok=True)
        self.writer = SummaryWriter(str(self.dir / "tensorboard"))
        self.history = self.dir / "metrics.jsonl"
        self.ray_metrics = RayMetrics(self.dir.name)
        self.progress = Progress(first=first_step, total=total_steps)
        # image grids are drawn and encoded (PNG, tensorboard) off the training loop's thread: 2.3-2.7 s for 16
        # images of 512² on the step that logs them, measured on 4x H200 (docs/perf/scale/lease4_4xh200/)
        self.drawing = ThreadPoolExecutor(max_workers=1, thread_name_prefix="image-grid")

    def step_done(self, step: int, metrics: dict[str, float]) -> None:
        """Step `step` (0-based) is done: its metrics to tensorboard, the history and Ray; its progress line."""
        self.log(step + 1, metrics)
        self.ray_metrics.record(images=int(metrics["rollout/images"]), reward_mean=metrics["reward/mean"],
                                adapter_version=int(metrics["rollout/adapter_version"]),
                                step_seconds=metrics["timing/step_s"])
        self.progress.step_done(step, metrics)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()
        # the wall clock beside each step (as tensorboard keeps it): what a restart or a stall cost reads from it
        with self.history.open("a") as f:
            f.write(json.dumps({"step": step, "time": round(time.time(), 3), **metrics}) + "\n")

    def log_images(self, step: int, images: np.ndarray, prompts: list[str],
                   rewards: list[dict[str, list[float]]]) -> Future:
        """uint8 [N, H, W, 3] images, one row per prompt group, each labelled with its rewards (`rewards[g]`:
        {"total": [...], component: [...]}), as a PNG and a tensorboard image, drawn by a background thread: returns
        at once, with a future of the PNG's path (`close` waits for every grid). Videos [N, F, H, W, 3]: the PNG
        shows each as a filmstrip of its frames, and an mp4 beside it plays the labelled grid. A grid that fails is
        said on stderr and costs the run nothing."""
        future = self.drawing.submit(self._draw_images, step, images, prompts, rewards)
        future.add_done_callback(_say_if_failed)
        return future

    def _draw_images(self, step: int, images: np.ndarray, prompts: list[str],
                     rewards: list[dict[str, list[float]]]) -> Path:
        path = self.dir / "images" / f"step_{step:06d}.png"
        if images.ndim == 5:  # videos: the labelled grid playing, and a filmstrip of each for the PNG
            write_mp4([labelled_grid(images[:, t], prompts, rewards) for t in range(images.shape[1])],
                      path.with_suffix(".mp4"))
            images = np.stack([filmstrip(video) for video in images])
            prompts, rewards = one_per_row(prompts, rewards, len(images))  # a filmstrip is wide: one a row
        grid = labelled_grid(images, prompts, rewards)
        from PIL import Image

        Image.fromarray(grid).save(path)
        self.writer.add_image("samples", grid, step, dataformats="HWC")
        self.writer.add_text("samples/prompts", "\n\n".join(prompts), step)
        return path

    def close(self) -> None:
        self.drawing.shutdown(wait=True)
        self.writer.close()


def _say_if_failed(future: Future) -> None:
    if future.exception() is not None:
        print(f"[flowgrpo] the step's image grid was not logged: {future.exception()!r}", file=sys.stderr, flush=True)


def filmstrip(video: np.ndarray, frames: int = 6, gutter: int = 2) -> np.ndarray:
    """uint8 [F, H, W, 3] → [H, k·(W + gutter) − gutter, 3]: k ≤ `frames` frames evenly spaced from the first to the
    last, side by side with a white gutter between them."""
    picked = np.unique(np.linspace(0, len(video) - 1, min(frames, len(video))).round().astype(int))
    white = np.full((video.shape[1], gutter, 3), 255, dtype=np.uint8)
    parts = [part for k in picked for part in (white, video[k])][1:]
    return np.concatenate(parts, axis=1)


def one_per_row(prompts: list[str], rewards: list[dict[str, list[float]]], n: int):
    """Each group's prompt and rewards repeated for each of its members, so that a grid has one member a row."""
    per = n // len(prompts)
    return ([p for p in prompts for _ in range(per)],
            [{k: [v[j]] for k, v in r.items()} for r in rewards for j in range(per)])


def write_mp4(frames, path: str | Path, fps: int = 16) -> Path:
    """uint8 [H, W, 3] frames → an H.264 mp4 at `fps` (Wan's 16) in `path`."""
    Path(path).write_bytes(mp4_bytes(frames, fps))
    return Path(path)


def mp4_bytes(frames, fps: int = 16) -> bytes:
    """uint8 [H, W, 3] frames (a list, or an array [F, H, W, 3]) → the bytes of an H.264 mp4 at `fps`, padded white
    to even sides (yuv420p needs them). PyAV (FFmpeg's libraries), which vllm-omni brings."""
    import io

    import av

    h, w = frames[0].shape[:2]
    even_h, even_w = h + h % 2, w + w % 2
    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = even_w, even_h, "yuv420p"
        for frame in frames:
            if (h, w) != (even_h, even_w):
                frame = np.pad(frame, ((0, even_h - h), (0, even_w - w), (0, 0)), constant_values=255)
            container.mux(stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(frame), format="rgb24")))
        container.mux(stream.encode())
    return buffer.getvalue()


def image_grid(images: np.ndarray, rows: int) -> np.ndarray:
    """uint8 [N, H, W, 3] → one [rows·H, cols·W, 3] grid (row-major; N must be rows × cols)."""
    n, h, w, c = images.shape
    cols = n // rows
    if rows * cols != n:
        raise ValueError(f"{n} images do not fill {rows} rows")
    return images.reshape(rows, cols, h, w, c).transpose(0, 2, 1, 3, 4).reshape(rows * h, cols * w, c)


def labelled_grid(images: np.ndarray, prompts: list[str], rewards: list[dict[str, list[float]]],
                  min_side: int = 192) -> np.ndarray:
    """A picture a person reads: one row per prompt group with the prompt above it, every image upscaled (nearest,
    an integer factor, so pixels stay pixels) to at least `min_side` and labelled with its total reward, and with
    each component's when there is more than one. images: uint8 [rows·cols, H, W, 3]."""
    from PIL import Image, ImageDraw, ImageFont

    rows = len(prompts)
    n, h, w, _ = images.shape
    cols = n // rows
    if rows * cols != n or len(rewards) != rows:
        raise ValueError(f"{n} images, {rows} prompts and {len(rewards)} reward rows do not make a grid")
    scale = max(1, -(-min_side // min(h, w)))  # ceil
    font = ImageFont.load_default(size=13)
    line, pad = 16, 6
    components = [k for k in rewards[0] if k != "total"]
    label_lines = 1 + (len(components) if len(components) > 1 else 0)
    cell_w, cell_h = w * scale, h * scale + label_lines * line + pad
    header = line + pad
    canvas = Image.new("RGB", (pad + cols * (cell_w + pad), rows * (header + cell_h) + pad), "white")
    draw = ImageDraw.Draw(canvas)
    for r, (prompt, scores) in enumerate(zip(prompts, rewards, strict=True)):
        top = pad + r * (header + cell_h)
        draw.text((pad, top), _fit(draw, f"{r + 1}. {prompt}", font, canvas.width - 2 * pad), fill="black",
                  font=font)
        for c in range(cols):
            k, left = r * cols + c, pad + c * (cell_w + pad)
            image = Image.fromarray(images[k]).resize((cell_w, h * scale), Image.Resampling.NEAREST)
            canvas.paste(image, (left, top + header))
            y = top + header + h * scale + 2
            draw.text((left, y), f"reward {scores['total'][c]:+.3f}", fill="black", font=font)
            for name in components if len(components) > 1 else []:
                y += line
                draw.text((left, y), _fit(draw, f"{name} {scores[name][c]:+.3f}", font, cell_w), fill="dimgray",
                          font=font)
    return np.asarray(canvas)


def _fit(draw, text: str, font, width: int) -> str:
    """`text`, cut with an ellipsis to fit `width` pixels."""
    if draw.textlength(text, font=font) <= width:
        return text
    while text and draw.textlength(text + "…", font=font) > width:
        text = text[:-1]
    return text + "…"


def latest_records(path: str | Path, key: str) -> dict:
    """{record[key]: record} of a JSON-lines file, the last record of each key winning (a resumed run rewrites
    steps), in the order the keys first appear; {} when there is no file."""
    path = Path(path)
    if not path.is_file():
        return {}
    latest = {}
    for line in path.read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            latest[record[key]] = record
    return latest


def read_history(run_dir: str | Path) -> list[dict]:
    """The per-step metrics of a run, one dict per step (the last record wins when a resumed run rewrote steps)."""
    by_step = latest_records(Path(run_dir) / "metrics.jsonl", "step")
    return [by_step[s] for s in sorted(by_step)]


def plot_reward_curve(history: list[dict], path: str | Path) -> Path:
    """Mean reward per step (the batch std as a band), and one panel per reward component (own scale)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in history]
    components = sorted({k.split("/")[1] for r in history for k in r
                         if k.startswith("reward/") and k.endswith("/mean") and k.count("/") == 2})
    fig, axes = plt.subplots(1 + len(components), 1, figsize=(6, 2.2 * (1 + len(components))), dpi=120,
                             sharex=True, squeeze=False)
    mean = np.array([r["reward/mean"] for r in history])
    std = np.array([r.get("reward/std", 0.0) for r in history])
    axes[0, 0].plot(steps, mean, marker="o", markersize=3)
    axes[0, 0].fill_between(steps, mean - std, mean + std, alpha=0.2)
    axes[0, 0].set_ylabel("reward (total)")
    for ax, name in zip(axes[1:, 0], components, strict=True):
        ax.plot(steps, [r.get(f"reward/{name}/mean", np.nan) for r in history], marker="o", markersize=3,
                color="tab:orange")
        ax.set_ylabel(name, fontsize=8)
    for ax in axes[:, 0]:
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("optimizer step (mean over the step's rollouts)")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return Path(path)


class RayMetrics:
    """Counters and gauges in Ray's metrics system (dashboard → Metrics; Prometheus `ray_flowgrpo_*`)."""

    def __init__(self, run: str):
        from ray.util.metrics import Counter, Gauge, Histogram

        tags = {"run": run}
        self.images = Counter("flowgrpo_images_generated", "rollout images generated for training",
                              tag_keys=("run",))
        self.reward = Gauge("flowgrpo_reward_mean", "mean reward of the last step's rollouts", tag_keys=("run",))
        self.version = Gauge("flowgrpo_adapter_version", "LoRA version published to the rollout replicas",
                             tag_keys=("run",))
        self.step_time = Histogram("flowgrpo_step_seconds", "wall time of one optimizer step",
                                   boundaries=[0.5, 1, 2, 5, 10, 20, 60, 120, 300], tag_keys=("run",))
        for metric in (self.images, self.reward, self.version, self.step_time):
            metric.set_default_tags(tags)

    def record(self, *, images: int, reward_mean: float, adapter_version: int, step_seconds: float) -> None:
        self.images.inc(images)
        self.reward.set(reward_mean)
        self.version.set(adapter_version)
        self.step_time.observe(step_seconds)


class NullRunLog:
    """What ranks other than 0 log: nothing (the same methods as `RunLog`)."""

    def step_done(self, step: int, metrics: dict[str, float]) -> None:
        pass

    def log(self, step: int, metrics: dict[str, float]) -> None:
        pass

    def log_images(self, step: int, images, prompts, rewards) -> None:
        pass

    def close(self) -> None:
        pass


class PhaseTimer:
    """Wall time of a step's phases: `with timer("rollout"): ...`, then `timer.metrics()` → {"timing/rollout_s"}.
    sync: called as each phase ends (a GPU's queued work belongs to the phase that queued it)."""

    def __init__(self, sync=None):
        self.started, self.seconds, self.sync = time.perf_counter(), {}, sync

    @contextmanager
    def __call__(self, phase: str):
        began = time.perf_counter()
        try:
            yield
        finally:
            if self.sync is not None:
                self.sync()
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - began

    def metrics(self) -> dict[str, float]:
        """Each phase's seconds, the whole step's, and `other`: the step outside every phase."""
        step = time.perf_counter() - self.started
        return {**{f"timing/{k}_s": v for k, v in self.seconds.items()}, "timing/step_s": step,
                "timing/other_s": max(0.0, step - sum(self.seconds.values()))}


class BusyClock:
    """An engine's busy seconds shared among the requests in flight: while k requests are in flight each is charged
    1/k of the time, so the charges of all requests add up to the time the engine had work (an engine that queues
    concurrent requests would otherwise count the queueing twice). `token = clock.enter()`, then
    `clock.leave(token)` returns that request's charge."""

    def __init__(self, now=time.perf_counter):
        self._now = now
        self._charges: dict[int, float] = {}  # token -> seconds charged so far
        self._since = 0.0  # the last time the in-flight set changed
        self._tokens = itertools.count()

    def _settle(self) -> None:
        now = self._now()
        if self._charges:
            share = (now - self._since) / len(self._charges)
            for token in self._charges:
                self._charges[token] += share
        self._since = now

    def enter(self) -> int:
        self._settle()
        token = next(self._tokens)
        self._charges[token] = 0.0
        return token

    def leave(self, token: int) -> float:
        self._settle()
        return self._charges.pop(token)


def throughput(metrics: dict[str, float], *, useful_tflop: float, gpus: float) -> dict[str, float]:
    """Images per second, useful TFLOP (app/flops.py) and, on GPUs, the whole-step model FLOPs utilisation and
    images per second per GPU, from a step's `rollout/images` and `timing/step_s`."""
    from app.flops import mfu

    seconds = metrics["timing/step_s"]
    out = {"perf/images_per_s": metrics["rollout/images"] / seconds, "perf/useful_tflop": useful_tflop}
    if gpus > 0:
        out["perf/images_per_s_per_gpu"] = out["perf/images_per_s"] / gpus
        out["perf/mfu"] = mfu(useful_tflop * 1e12, seconds, gpus)
    return out


def busy_shares(metrics: dict[str, float], *, rollout_busy_s: float, replicas: int, replica_gpus: float,
                workers: int, worker_gpus: float) -> dict[str, float]:
    """How much of a step the rollout replicas and the trainer spent computing, from `timing/step_s`, the trainer's
    `timing/train_s` (+ `recompute_s`) and the engines' seconds for the groups trained (`rollout_busy_s`, over all
    replicas; with a pipelined loop they were generated during earlier steps, which evens out over a run).

    On GPUs, `perf/gpu_idle_share`: the share of the run's GPU time (whole GPUs: replicas and workers holding
    fractions share them) in which no process computed. A process computing occupies the whole GPUs it holds part
    of; two sharing a GPU are assumed not to overlap (a pipelined run's contention counts as use, so 0 there is a
    floor, not a measurement)."""
    step = metrics["timing/step_s"]
    rollout = min(1.0, rollout_busy_s / max(1, replicas) / step)
    trainer = min(1.0, (metrics.get("timing/train_s", 0.0) + metrics.get("timing/recompute_s", 0.0)) / step)
    out = {"perf/rollout_busy_share": rollout, "perf/trainer_busy_share": trainer}
    held = math.ceil(replicas * replica_gpus + workers * worker_gpus - 1e-9)
    if held > 0:
        used = rollout * replicas * math.ceil(replica_gpus) + trainer * workers * math.ceil(worker_gpus)
        out["perf/gpu_idle_share"] = max(0.0, 1 - used / held)
    return out


def reward_metrics(rewards: dict) -> dict[str, float]:
    total = np.array([r.total for r in rewards.values()])
    out = {"reward/mean": float(total.mean()), "reward/std": float(total.std()),
           "reward/min": float(total.min()), "reward/max": float(total.max())}
    for name in next(iter(rewards.values())).components:
        out[f"reward/{name}/mean"] = float(np.mean([r.components[name] for r in rewards.values()]))
    return out


def _extreme(key: str) -> str | None:
    """Which extreme a metric keeps ("max" for `..._max`, "min" for `..._min`), None for a mean."""
    return key.rsplit("_", 1)[-1] if key.endswith(("_max", "_min")) else None


def _reduction(key: str) -> str | None:
    """How a metric combines over workers: its extreme, "sum" for `..._sum`, None for the mean."""
    return "sum" if key.endswith("_sum") else _extreme(key)


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


def reduce_over_workers(metrics: dict[str, float], world: int) -> dict[str, float]:
    """Means over the workers that report a key, max/min/sum for `_max`/`_min`/`_sum` keys (a `_sum` key loses its
    suffix: it is the whole step's). A collective: every rank calls it, with its own keys; the ranks first agree on
    the union, so a key some rank lacks (a group kind only some ranks trained) costs that rank nothing instead of
    a mismatched all-reduce, which would hang NCCL."""
    import torch
    import torch.distributed as dist

    everyone: list[list[str] | None] = [None] * world
    dist.all_gather_object(everyone, sorted(metrics))
    keys = sorted(set().union(*everyone))
    # NCCL reduces GPU tensors only
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    absent = {"max": -math.inf, "min": math.inf, "sum": 0.0, None: 0.0}
    out = {}
    for kind, op in [("max", dist.ReduceOp.MAX), ("min", dist.ReduceOp.MIN), ("sum", dist.ReduceOp.SUM),
                     (None, dist.ReduceOp.SUM)]:
        chosen = [k for k in keys if _reduction(k) == kind]  # the same keys in the same order on every rank
        if not chosen:
            continue
        values = torch.tensor([[metrics.get(k, absent[kind]) for k in chosen],
                               [float(k in metrics) for k in chosen]], dtype=torch.float64, device=device)
        dist.all_reduce(values, op=op)
        reduced = values[0] / values[1] if kind is None else values[0]  # a mean over the ranks that have the key
        names = [k.removesuffix("_sum") for k in chosen] if kind == "sum" else chosen
        out.update(zip(names, reduced.cpu().tolist(), strict=True))
    return out


class Progress:
    """One line per step on the driver's console (Ray forwards worker stdout): the numbers a user watches."""

    def __init__(self, first: int, total: int):
        self.first, self.total, self.started = first, total, time.perf_counter()

    def step_done(self, step: int, metrics: dict[str, float]) -> None:
        done = step + 1 - self.first
        eta = (time.perf_counter() - self.started) / done * (self.total - step - 1)
        reward, loss = metrics["reward/mean"], metrics["actor/loss"]
        ratio_dev, mismatch = metrics["actor/ratio_dev_first_pass_max"], metrics["rollout/logprob_mismatch_max"]
        stale = metrics.get("actor/ratio_dev_stale_max", 0.0)  # groups of an earlier adapter (pipelined)
        # compiled after this process's first step: a change of shape or state the compiled blocks are guarded on
        new = {side: metrics.get(f"compile/{side}_new_frames", 0.0) for side in ("trainer", "rollout")}
        compiled = ", ".join(f"{side} +{n:.0f} frames" for side, n in new.items() if n) if done > 1 else ""
        # graphs the compile caches could not hold: a restart, a replacement replica or the next run compiles them
        # again (the caches' own log says why)
        uncached = ", ".join(
            f"{side} {n:.0f} graphs" for side in ("trainer", "rollout")
            if (n := sum(metrics.get(f"compile/{side}_{c}_bypasses_max", 0.0) for c in ("fx", "aot"))))
        print(f"[flowgrpo] step {step + 1}/{self.total}  reward {reward:+.4f}  loss {loss:+.2e}  "
              f"|ratio-1| first pass {ratio_dev:.1e}{f' (stale groups {stale:.1e})' if stale else ''}  "
              f"logprob mismatch {mismatch:.1e}  "
              f"staleness {metrics['rollout/staleness_max']:.0f}  {metrics['timing/step_s']:.1f}s/step  eta {eta:.0f}s"
              f"{f'  compiled again: {compiled}' if compiled else ''}"
              f"{f'  not cached: {uncached}' if uncached and done == 1 else ''}",
              file=sys.__stdout__, flush=True)  # the real stdout: Ray Train's print patch would log it twice
