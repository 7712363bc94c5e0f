"""A lease's runs in one table, from their raw `NAME_metrics.jsonl` files (what docs/perf/scale/README.md's tables
quote): the steps after the first pooled (images and useful FLOPs over the steps' seconds), step 1 beside them, and
the checks every run must pass (first-pass |ratio - 1|, compilations after step 1).
    python docs/perf/scale/summarize.py docs/perf/scale/lease4_4xh200 [--baseline split_k1]
--baseline: the run whose img/s/GPU the others are divided by (weak scaling against the 2-GPU split of a lease)."""

import argparse
import json
import statistics
from pathlib import Path



def summary(path: Path) -> dict:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    steady = [r for r in rows if r["step"] >= 2]
    seconds = sum(r["timing/step_s"] for r in steady)
    gpus = steady[0]["perf/images_per_s"] / steady[0]["perf/images_per_s_per_gpu"]

    def mean(key: str) -> float:
        return statistics.fmean(r.get(key, 0.0) for r in steady)

    return {"run": path.name.removesuffix("_metrics.jsonl"), "gpus": round(gpus, 2), "steps": len(rows),
            "s_per_step": seconds / len(steady),
            "img_s_gpu": sum(r["rollout/images"] for r in steady) / seconds / gpus,
            # each step's MFU weighted by its seconds: the steps' useful FLOPs over their seconds and GPUs
            "mfu": sum(r["perf/mfu"] * r["timing/step_s"] for r in steady) / seconds,
            "busy": (mean("perf/rollout_busy_share"), mean("perf/trainer_busy_share")),
            "train_s": mean("timing/train_s"), "publish_s": mean("timing/publish_s"),
            "publication_s": mean("timing/publication_s_max"),
            "peak_gib": (max(r.get("memory/rollout_peak_gib_max", 0.0) for r in rows),
                         max(r.get("memory/trainer_peak_gib_max", 0.0) for r in rows)),
            "step1_s": rows[0]["timing/step_s"] if rows[0]["step"] == 1 else float("nan"),
            "ratio_dev_max": max(r.get("actor/ratio_dev_first_pass_max", 0.0) for r in rows),
            "new_frames_after_1": sum(r.get("compile/trainer_new_frames", 0.0)
                                      + r.get("compile/rollout_new_frames", 0.0) for r in steady)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder")
    parser.add_argument("--baseline", help="a run of the folder: the others' img/s/GPU over its")
    args = parser.parse_args()
    runs = [summary(p) for p in sorted(Path(args.folder).glob("*_metrics.jsonl"))]
    base = next((r["img_s_gpu"] for r in runs if r["run"] == args.baseline), None)
    if args.baseline and base is None:
        raise SystemExit(f"--baseline {args.baseline}: no {args.baseline}_metrics.jsonl in {args.folder}")
    print("| run | GPUs | steps | s/step | img/s/GPU | effective MFU | busy rollout / trainer | train phase | publish "
          "(blocking) | publication (background) | peak GiB replica / rank | step 1 | max first-pass abs(ratio - 1) "
          "| new frames after step 1 |")
    print("| --- " * 14 + "|")
    for r in runs:
        scaling = f" ({r['img_s_gpu'] / base:.2f}x)" if base and r["run"] != args.baseline else ""
        print(f"| `{r['run']}` | {r['gpus']:g} | {r['steps']} | {r['s_per_step']:.2f} | {r['img_s_gpu']:.3f}{scaling} "
              f"| {100 * r['mfu']:.1f} % | {r['busy'][0]:.2f} / {r['busy'][1]:.2f} | {r['train_s']:.2f} s "
              f"| {r['publish_s']:.2f} s | {r['publication_s']:.2f} s "
              f"| {r['peak_gib'][0]:.1f} / {r['peak_gib'][1]:.1f} "
              f"| {r['step1_s']:.1f} s | {r['ratio_dev_max']:.1g} | {r['new_frames_after_1']:g} |")


if __name__ == "__main__":
    main()
