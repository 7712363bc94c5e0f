"""The learning check's picture (issue 34 point 4): the JPEG reward of the trained run and of the same run at lr 0
(same seeds, so the same prompts and noise at every step), per training step and on the eval set.
    python docs/perf/scale/plot_learning.py docs/perf/scale/lanes_4xh200"""

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def rows(path: Path, key: str) -> tuple[list[int], list[float]]:
    out = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r["step"] for r in out], [r[key] for r in out]


def main(folder: str) -> None:
    d = Path(folder)
    runs = {"lr 3e-4": "learn_lr3e-4", "lr 0": "learn_lr0"}
    fig, (train, paired, evals) = plt.subplots(1, 3, figsize=(15, 4.2))
    steps = {}
    for label, name in runs.items():
        s, r = rows(d / f"{name}_metrics.jsonl", "reward/mean")
        steps[label] = dict(zip(s, r))
        train.plot(s, r, marker=".", label=label)
        e, er = rows(d / f"{name}_eval.jsonl", "eval/reward/mean")
        evals.plot(e, er, marker="o", label=label)
    both = sorted(set(steps["lr 3e-4"]) & set(steps["lr 0"]))
    paired.bar(both, [steps["lr 3e-4"][s] - steps["lr 0"][s] for s in both], color="tab:green")
    paired.axhline(0, color="black", lw=0.8)
    train.set(title="training reward (16 images a step)", xlabel="step", ylabel="JPEG compressibility reward")
    paired.set(title="trained − lr 0, step by step (same prompts and noise)", xlabel="step", ylabel="reward difference")
    evals.set(title="eval set (16 held-out prompts, fixed noise)", xlabel="step", ylabel="mean reward")
    for ax in (train, evals):
        ax.legend()
    fig.suptitle("Real-size Qwen-Image (random weights), 2x H200 split 1 + 1, compiled k = 1, diffusers engine")
    fig.tight_layout()
    fig.savefig(d / "learning_check.png", dpi=90)
    print(d / "learning_check.png")


if __name__ == "__main__":
    main(sys.argv[1])
