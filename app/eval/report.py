"""What an evaluation leaves behind, in a run folder (`<logging.dir>/eval/`) or a `jobs.evaluate` folder:

    metrics.jsonl           one line per evaluation: step, adapter version, eval/ and sentinel/ metrics (or the
                            error of an evaluation that failed)
    step_XXXXXX.jsonl       one line per image: prompt, seed, target text, reward and every term, OCR text, exact match
    grid_step_XXXXXX.png    the first `eval.grid_prompts` prompts, labelled with their rewards: the same prompts
                            and noise every time, so a person watches the same images change
    base_images.npz         the base model's images (adapter off) the sentinels compare with, made once per run
    ../eval_curve.png       (run folder) eval reward, terms and OCR accuracy against the training step

and in tensorboard (a run's) under `eval/` and `sentinel/`.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from app.eval.evaluate import Evaluation
from app.eval.sentinels import out_of_band, sentinels
from app.metrics import filmstrip, labelled_grid, latest_records, one_per_row

BASE_IMAGES = "base_images.npz"


def sentinel_metrics(evaluation: Evaluation, base_images: np.ndarray,
                     bands: dict[str, list[float]]) -> tuple[dict[str, float], list[str]]:
    """(sentinel/ metrics of the evaluation's images against the base model's, a warning line per banded value
    outside its band)."""
    values = sentinels(evaluation.flat_images(), base_images.reshape(-1, *base_images.shape[2:]))
    warnings = [f"sentinel {name}={value:+.3f} is outside its band [{band[0]:g}, {band[1]:g}] "
                f"(eval.sentinel_bands.{name}): {_HINTS.get(name, '')}"
                for name, (value, band) in out_of_band(values, bands).items()]
    metrics = {f"sentinel/{k}": v for k, v in values.items()}
    metrics["sentinel/out_of_band"] = float(len(warnings))
    return metrics, warnings


_HINTS = {
    "colour_entropy_change": "the adapter's images use far fewer (or more) colours than the base model's "
                             "(an erased background?)",
    "edge_energy_change": "far more (or less) pixel-to-pixel contrast than the base model's (grid artefacts?)",
    "brightness_change": "the images drift darker or brighter than the base model's",
    "dark_fraction_change": "far more (or fewer) dark pixels than the base model's",
    "distance_to_base": "the images moved far from the base model's for the same prompts and noise",
}


class EvalLog:
    """Writes evaluations into `directory` (and to a tensorboard `writer`, if given)."""

    def __init__(self, directory: str | Path, *, grid_prompts: int = 8, writer=None):
        self.dir = Path(directory)  # made by the first write
        self.grid_prompts, self.writer = grid_prompts, writer

    # the sentinels' reference
    def save_base(self, evaluation: Evaluation) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        np.savez_compressed(self.dir / BASE_IMAGES, images=evaluation.images, seeds=np.array(evaluation.seeds),
                            prompts=np.array(evaluation.prompts))

    def load_base(self, prompts: list[str], seeds: list[int], shape: tuple) -> np.ndarray | None:
        """The saved base images, if they were made for exactly these prompts, seeds and image shape."""
        path = self.dir / BASE_IMAGES
        if not path.is_file():
            return None
        saved = np.load(path)
        if (list(saved["prompts"]) != list(prompts) or [int(s) for s in saved["seeds"]] != list(seeds)
                or saved["images"].shape[1:] != tuple(shape)):
            return None
        return saved["images"]

    def write(self, name: str, step: int | None, evaluation: Evaluation, extra: dict[str, float]) -> dict:
        """Per-image lines, the grid and one metrics line of an evaluation (named `name`: a step, an adapter);
        returns the metrics line."""
        self.dir.mkdir(parents=True, exist_ok=True)
        with (self.dir / f"{name}.jsonl").open("w") as f:
            for record in evaluation.records():
                f.write(json.dumps(record) + "\n")
        grid = self.grid(evaluation)
        if grid is not None:
            from PIL import Image

            Image.fromarray(grid).save(self.dir / f"grid_{name}.png")
        line = {"name": name, **({"step": step} if step is not None else {}), "adapter_version": evaluation.version,
                **evaluation.metrics(), **extra}
        self._append(line)
        if self.writer is not None and step is not None:
            for key, value in line.items():
                if key.startswith(("eval/", "sentinel/")):
                    self.writer.add_scalar(key, value, step)
            if grid is not None:
                self.writer.add_image("eval/grid", grid, step, dataformats="HWC")
            self.writer.flush()
        return line

    def failed(self, name: str, step: int | None, version: int, error: str) -> dict:
        line = {"name": name, **({"step": step} if step is not None else {}), "adapter_version": version,
                "eval/failed": 1.0, "error": error}
        self._append(line)
        if self.writer is not None and step is not None:
            self.writer.add_scalar("eval/failed", 1.0, step)
            self.writer.flush()
        return line

    def grid(self, evaluation: Evaluation) -> np.ndarray | None:
        g = min(self.grid_prompts, len(evaluation.prompts))
        if g == 0:
            return None
        rows = [{"total": s.total, **s.components} for s in evaluation.rewards[:g]]
        images = evaluation.images[:g].reshape(-1, *evaluation.images.shape[2:])
        prompts = evaluation.prompts[:g]
        if images.ndim == 5:  # videos: a filmstrip of each, one a row
            images = np.stack([filmstrip(video) for video in images])
            prompts, rows = one_per_row(prompts, rows, len(images))
        return labelled_grid(images, prompts, rows)

    def _append(self, line: dict) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        with (self.dir / "metrics.jsonl").open("a") as f:
            f.write(json.dumps(line) + "\n")

    def history(self) -> list[dict]:
        """Every evaluation line written, in order (the last one of a step wins)."""
        return list(latest_records(self.dir / "metrics.jsonl", "name").values())


def plot_eval_curve(history: list[dict], path: str | Path) -> Path | None:
    """Eval reward (total and each term) and OCR accuracy / exact match against the training step."""
    rows = sorted((r for r in history if "step" in r and "eval/reward/mean" in r), key=lambda r: r["step"])
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    terms = sorted(k for k in rows[0] if k.startswith("eval/reward/") and k not in ("eval/reward/mean",
                                                                                    "eval/reward/std"))
    ocr = "eval/ocr_accuracy" in rows[0]
    terms = [t for t in terms if not (ocr and t == "eval/reward/ocr")]  # the OCR accuracy panel shows it
    panels = 1 + len(terms) + ocr
    fig, axes = plt.subplots(panels, 1, figsize=(6, 2.2 * panels), dpi=120, sharex=True, squeeze=False)
    steps = [r["step"] for r in rows]
    axes[0, 0].plot(steps, [r["eval/reward/mean"] for r in rows], marker="o", color="tab:green")
    axes[0, 0].set_ylabel("eval reward (total)")
    for ax, key in zip(axes[1:, 0], terms, strict=False):
        ax.plot(steps, [r.get(key, np.nan) for r in rows], marker="o", color="tab:olive")
        ax.set_ylabel(key.removeprefix("eval/reward/"), fontsize=8)
    if ocr:
        ax = axes[-1, 0]
        ax.plot(steps, [r["eval/ocr_accuracy"] for r in rows], marker="o", label="OCR accuracy")
        ax.plot(steps, [r["eval/ocr_exact_match"] for r in rows], marker="s", label="exact match")
        ax.set_ylim(-0.05, 1.05)
        ax.legend(fontsize=7)
    for ax in axes[:, 0]:
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("optimizer step (held-out prompts, fixed noise)")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return Path(path)
