"""Issue 54's learning check as a picture: the training reward per step of the same run with its ODE steps at the
model's precision, in FP8 (`rollout.ode_steps.precision=fp8`) and at lr 0, the same seeds (the same prompts and
noise each step), and each trained run's difference from the lr 0 run of its seed step by step.
    python docs/perf/ode_steps/plot_learning.py FOLDER [MORE_FOLDERS...] [--title "one H200, ..."]
(each FOLDER holds `ode_{model,fp8,lr0}[_seedN]_metrics.jsonl`, as gpu_runs.sh's job stage names them: no suffix is
seed 0. Several folders: one lease's seed 0 beside another's seed 1; the picture goes to the first.) Prints, per run,
the reward over the last 10 steps and its gain over the same seed's lr 0 there: the verdict compares FP8's gains with
the range of the model precision's."""

import argparse
import json
import re
import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

KINDS = {"model": "model precision", "fp8": "FP8 ODE steps", "lr0": "lr 0"}
NAME = re.compile(r"ode_(model|fp8|lr0)(?:_seed(\d+))?_metrics\.jsonl")


def rewards(path: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {r["step"]: r["reward/mean"] for r in rows}


def runs_in(folders: list[str]) -> dict[tuple[str, int], dict[int, float]]:
    """{(kind, seed): {step: reward}} from every folder (a later folder's run of the same kind and seed wins)."""
    found = {}
    for folder in folders:
        for path in sorted(Path(folder).glob("ode_*_metrics.jsonl")):
            if m := NAME.fullmatch(path.name):
                found[(m[1], int(m[2] or 0))] = rewards(path)
    return found


def default_title(folder: str) -> str:
    """"one <GPU>, ..." from the lease's device.txt (nvidia-smi's CSV: its second line starts with the name)."""
    try:
        gpu = open(f"{folder}/device.txt").read().splitlines()[1].split(",")[0].strip()
    except (OSError, IndexError):
        gpu = "GPU not recorded"
    return f"one {gpu}, Z-Image-Turbo recipe at real size (random weights), JPEG reward"


def last10(by_step: dict[int, float]) -> list[float]:
    return [by_step[s] for s in sorted(by_step)[-10:]]


def main(folders: list[str], title: str) -> None:
    runs = runs_in(folders)
    fig, (curves, paired) = plt.subplots(1, 2, figsize=(12, 4.2))
    gains: dict[str, list[float]] = {"model": [], "fp8": []}
    for (kind, seed), by_step in sorted(runs.items(), key=lambda item: (item[0][1], list(KINDS).index(item[0][0]))):
        label = KINDS[kind] + (f", seed {seed}" if seed else "")
        curves.plot(list(by_step), list(by_step.values()), marker=".", label=label)
        line = f"{label}: reward over the last 10 steps {statistics.fmean(last10(by_step)):.4f}"
        line += f" (sd {statistics.stdev(last10(by_step)):.4f})"
        base = runs.get(("lr0", seed))
        if kind != "lr0" and base:
            steps = sorted(set(by_step) & set(base))
            diff = [by_step[s] - base[s] for s in steps]
            paired.plot(steps, diff, marker=".", label=f"{label} − lr 0")
            gains[kind].append(statistics.fmean(diff[-10:]))
            line += f", over lr 0 {gains[kind][-1]:+.4f}"
        print(line)
    if gains["model"] and gains["fp8"]:
        low, high = min(gains["model"]), max(gains["model"])
        inside = all(low <= g <= high for g in gains["fp8"]) if len(gains["model"]) > 1 else None
        print(f"gain over lr 0, last 10 steps: model precision {[round(g, 3) for g in gains['model']]}, "
              f"FP8 {[round(g, 3) for g in gains['fp8']]}; FP8 within the model precision's range: "
              f"{'needs two seeds of the model precision' if inside is None else inside}")
    paired.axhline(0, color="black", lw=0.8)
    curves.set(title="training reward", xlabel="step", ylabel="JPEG compressibility reward")
    paired.set(title="trained − lr 0 of its seed, step by step (same prompts and noise)", xlabel="step",
               ylabel="reward difference")
    for ax in (curves, paired):
        ax.legend(fontsize="small")
    fig.suptitle(title)
    fig.tight_layout()
    out = Path(folders[0]) / "ode_steps_learning_check.png"
    fig.savefig(out, dpi=90)
    print(out)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folders", nargs="+")
    parser.add_argument("--title", default=None, help="default: the GPU named in the first folder's device.txt")
    args = parser.parse_args()
    main(args.folders, args.title or default_title(args.folders[0]))
