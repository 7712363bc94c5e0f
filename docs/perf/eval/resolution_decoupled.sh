#!/usr/bin/env bash
# Resolution-decoupled training on the tiny CPU config, side by side on one machine, one run after the other:
# rollout (training) at 32x32 against 64x64, both evaluated at 64x64 every 8 steps and before the first, interleaved
# 32, 64, 32, 64 (the shared machine's speed drifts).
#   bash docs/perf/eval/resolution_decoupled.sh [OUT]    (about 12 minutes on 2 cores)
set -euo pipefail
cd "$(dirname "$0")/../../.."
OUT=${1:-/tmp/resolution_decoupled}
rm -rf "$OUT"
PY=.venv/bin/python
for round in 1 2; do
  for side in 32 64; do
    $PY -m jobs.train --config configs/tiny_cpu.yaml logging.dir="$OUT/train${side}_$round" \
        rollout.height=$side rollout.width=$side eval.height=64 eval.width=64 > "$OUT.train${side}_$round.log" 2>&1
  done
done
$PY - "$OUT" <<'PY'
import json, statistics, sys
from pathlib import Path
out = Path(sys.argv[1])
def read(name):
    steps = [json.loads(l) for l in (out / name / "metrics.jsonl").read_text().splitlines()]
    evals = [json.loads(l) for l in (out / name / "eval" / "metrics.jsonl").read_text().splitlines()]
    return steps, evals
rows = {}
for side, run in ((32, 1), (64, 1), (32, 2), (64, 2)):
    steps, evals = read(f"train{side}_{run}")
    step_s = [s["timing/step_s"] for s in steps[1:]]  # step 1 warms up
    rows[side] = rows.get(side, 0.0) + statistics.median(step_s)
    print(f"rollout {side}x{side} (run {run}): median s/step {statistics.median(step_s):.3f} (steps 2-24); "
          f"rollout {statistics.median(s['timing/rollout_s'] for s in steps[1:]):.3f} s, "
          f"train {statistics.median(s['timing/train_s'] for s in steps[1:]):.3f} s; "
          f"eval at 64x64: " + ", ".join(f"step {e['step']} reward {e['eval/reward/mean']:+.4f} "
                                          f"({e['eval/seconds']:.2f} s)" for e in evals))
print(f"speed-up of 32x32 training: {rows[64] / rows[32]:.2f}x per step (sums of the runs' medians)")
PY
