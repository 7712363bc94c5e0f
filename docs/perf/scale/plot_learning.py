"""The learning check's picture (issue 34 point 4, issue 38 point 3): the JPEG reward of the trained run and of the
same run at lr 0 (same seeds, so the same prompts and noise at every step), per training step and on the eval set.
    python docs/perf/scale/plot_learning.py docs/perf/scale/lanes_4xh200
    python docs/perf/scale/plot_learning.py FOLDER --prefix q_ --title "4x H200, 2 replicas + 2 ranks, ..."
(the runs' files: PREFIXlearn_lr3e-4_metrics.jsonl, PREFIXlearn_lr0_eval.jsonl, ..., as gpu_runs.sh names them)"""

import argparse
import json
from collections import Counter
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def rows(path: Path, key: str) -> tuple[list[int], list[float]]:
    out = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r["step"] for r in out], [r[key] for r in out]


def main(folder: str, prefix: str = "", title: str = "2x H200 split 1 + 1") -> None:
    d = Path(folder)
    runs = {"lr 3e-4": f"{prefix}learn_lr3e-4", "lr 0": f"{prefix}learn_lr0"}
    fig, (train, paired, evals) = plt.subplots(1, 3, figsize=(15, 4.2))
    steps, images = {}, 0.0
    for label, name in runs.items():
        metrics = [json.loads(line) for line in (d / f"{name}_metrics.jsonl").read_text().splitlines() if line.strip()]
        images = metrics[-1]["rollout/images"]
        # a run whose trainer was killed logs the steps after its checkpoint twice: the rows after the restart count
        by_step = {m["step"]: m["reward/mean"] for m in metrics}
        redone = sorted(step for step, rows in Counter(m["step"] for m in metrics).items() if rows > 1)
        steps[label] = by_step
        train.plot(list(by_step), list(by_step.values()), marker=".", label=label)
        if redone:
            train.axvspan(redone[0] - 0.5, redone[-1] + 0.5, color="tab:red", alpha=0.15,
                          label=f"{label}: trainer killed, steps {redone[0]}-{redone[-1]} redone from its checkpoint")
        e, er = rows(d / f"{name}_eval.jsonl", "eval/reward/mean")
        evals.plot(e, er, marker="o", label=label)
    both = sorted(set(steps["lr 3e-4"]) & set(steps["lr 0"]))
    paired.bar(both, [steps["lr 3e-4"][s] - steps["lr 0"][s] for s in both], color="tab:green")
    paired.axhline(0, color="black", lw=0.8)
    train.set(title=f"training reward ({images:.0f} images a step)", xlabel="step",
              ylabel="JPEG compressibility reward")
    paired.set(title="trained − lr 0, step by step (same prompts and noise)", xlabel="step", ylabel="reward difference")
    evals.set(title="eval set (16 held-out prompts, fixed noise)", xlabel="step", ylabel="mean reward")
    for ax in (train, evals):  # under the axes: a curve may pass anywhere inside them
        ax.legend(fontsize="small", loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2)
    fig.suptitle(f"Real-size Qwen-Image (random weights), {title}, compiled k = 1, diffusers engine")
    fig.tight_layout()
    out = d / f"{prefix}learning_check.png"
    fig.savefig(out, dpi=90)
    print(out)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder")
    parser.add_argument("--prefix", default="", help="the runs' name prefix (q_: the 4-GPU runs of gpu_lanes.sh)")
    parser.add_argument("--title", default="2x H200 split 1 + 1", help="the machine and placement, for the title")
    args = parser.parse_args()
    main(args.folder, args.prefix, args.title)
