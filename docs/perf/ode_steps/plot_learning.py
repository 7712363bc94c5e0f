"""Issue 54's learning check as a picture: the training reward per step of the same run with its ODE steps at the
model's precision, in FP8 (`rollout.ode_steps.precision=fp8`) and at lr 0, the same seeds (the same prompts and
noise each step), and each trained run's difference from lr 0 step by step.
    python docs/perf/ode_steps/plot_learning.py FOLDER [--title "one H200, Z-Image-Turbo recipe, ..."]
(FOLDER holds ode_model_metrics.jsonl, ode_fp8_metrics.jsonl, ode_lr0_metrics.jsonl, as gpu_runs.sh's job stage
names them, and ode_model_seed1_metrics.jsonl where the lease ran it: the model's precision on another seed, whose
prompts and noise differ, drawn in the left panel only)"""

import argparse
import json
import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

RUNS = {"model precision": "ode_model", "FP8 ODE steps": "ode_fp8", "lr 0": "ode_lr0"}


def rewards(path: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {r["step"]: r["reward/mean"] for r in rows}


def default_title(folder: str) -> str:
    """"one <GPU>, ..." from the lease's device.txt (nvidia-smi's CSV: its second line starts with the name)."""
    try:
        gpu = open(f"{folder}/device.txt").read().splitlines()[1].split(",")[0].strip()
    except (OSError, IndexError):
        gpu = "GPU not recorded"
    return f"one {gpu}, Z-Image-Turbo recipe at real size (random weights), JPEG reward"


def main(folder: str, title: str) -> None:
    d = Path(folder)
    runs = {label: rewards(d / f"{name}_metrics.jsonl") for label, name in RUNS.items()}
    if (other := d / "ode_model_seed1_metrics.jsonl").exists():
        runs["model precision, seed 1"] = rewards(other)
    fig, (curves, paired) = plt.subplots(1, 2, figsize=(12, 4.2))
    for label, by_step in runs.items():
        curves.plot(list(by_step), list(by_step.values()), marker=".", label=label)
        last = list(by_step.values())[-10:]
        print(f"{label}: reward over the last 10 steps {statistics.fmean(last):.4f} (sd {statistics.stdev(last):.4f})")
    base = runs["lr 0"]
    for label in ("model precision", "FP8 ODE steps"):
        steps = sorted(set(runs[label]) & set(base))
        paired.plot(steps, [runs[label][s] - base[s] for s in steps], marker=".", label=f"{label} − lr 0")
    paired.axhline(0, color="black", lw=0.8)
    curves.set(title="training reward", xlabel="step", ylabel="JPEG compressibility reward")
    paired.set(title="trained − lr 0, step by step (same prompts and noise)", xlabel="step",
               ylabel="reward difference")
    for ax in (curves, paired):
        ax.legend(fontsize="small")
    fig.suptitle(title)
    fig.tight_layout()
    out = d / "ode_steps_learning_check.png"
    fig.savefig(out, dpi=90)
    print(out)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder")
    parser.add_argument("--title", default=None, help="default: the GPU named in FOLDER/device.txt, the recipe")
    args = parser.parse_args()
    main(args.folder, args.title or default_title(args.folder))
