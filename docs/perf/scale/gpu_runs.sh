#!/bin/bash
# The loop at scale on a lent multi-GPU machine: jobs.train with the real-size random Qwen-Image, the fast recipe
# (SDE window 2 of 10, 16 images a step, JPEG reward), placements and schedules side by side. One device-tool call
# per stage, back to back (a machine keeps /tmp only while calls follow each other). In the project root, the
# device wheels installed (../shared/tools/device-wheels --no-ocr), PYTHONPATH set:
#   bash docs/perf/scale/gpu_runs.sh build | job NAME STEPS [overrides...]
# (CHECK=1: each job's config is loaded and nothing runs: gpu_lanes.sh's plan checked on a CPU machine)
# Writes logs and metrics.jsonl into $OUT (the device tool's folder; ./out elsewhere). The leases before 2026-11-28
# ran the diffusers engine (the image's torch 2.11); with the pinned stack carried (docs/perf/vllm_omni/README.md)
# `rollout.engine=vllm_omni` runs vllm-omni replicas (with `rollout.merge_lora=true|false`).
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
MODEL=${MODEL:-/tmp/qwen-image-full}
CACHE=/tmp/compile_cache   # one inductor cache for every stage of a lease
CFG=configs/qwen_image_ocr_2gpu.yaml
FAST=(rollout.sde_window.size=2 "rollout.sde_window.range=[0,5]" train.timestep_fraction=1 train.groups_per_step=2)
JPEG=("reward.weights={jpeg_compressibility: 1.0}" train.seed=0 train.checkpoint_every=0 logging.image_every=0)
# more overrides for every job after it, as a lease's stage word (a stage word with "=" sets a variable there):
# "JOBARGS=rollout.engine=vllm_omni rollout.merge_lora=true"
read -r -a JOBARGS <<< "${JOBARGS:-}"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 RAY_COLOR_PREFIX=0

case "$1" in
  build)  # the real-size random Qwen-Image (60 blocks, 20.4B, bf16)
    [ -n "${CHECK:-}" ] && exit 0
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/device.txt"
    [ -f $MODEL/model_index.json ] || python -m jobs.make_tiny_models --preset qwen-image-full --out $MODEL 2>&1 | tail -1 ;;
  job|kill)  # job NAME STEPS [overrides]: e.g. job compiled_k1 10 train.max_staleness=1; kill: the same, and the
    # trainer's worker gets SIGKILL once step $KILL_AT is done (the run restarts from its last checkpoint)
    mode=$1; name=$2; steps=$3; shift 3
    if [ -n "${CHECK:-}" ]; then  # CHECK=1: a dry run of a lease's plan on any machine, each job's config loaded
      python -c 'import sys; from app.config import load; load(sys.argv[1], sys.argv[3:]); print(sys.argv[2], "config ok")' \
        $CFG $name model.path=$MODEL "${FAST[@]}" "${JPEG[@]}" train.num_steps=$steps "${JOBARGS[@]}" "$@" 2>&1 | tail -n 1
      exit 0
    fi
    if [ $mode = kill ]; then
      ( until grep -q "\[flowgrpo\] step ${KILL_AT:-5}/" "$OUT/$name.log" 2>/dev/null; do sleep 0.5; done
        for pid in $(pgrep -f "ray::RayTrainWorker"); do  # this run's worker: its cluster's RAY_TMPDIR (gpu_lanes.sh)
          tr '\0' '\n' < /proc/$pid/environ | grep -qx "RAY_TMPDIR=${RAY_TMPDIR:-}" || [ -z "${RAY_TMPDIR:-}" ] || continue
          kill -9 $pid && echo "killed the trainer's worker $pid at $(date +%s.%N)" >> "$OUT/$name.kill"; break
        done ) &
    fi
    timeout ${JOB_TIMEOUT:-560} python -m jobs.train --config $CFG model.path=$MODEL model.compile.cache_dir=$CACHE \
      "${FAST[@]}" "${JPEG[@]}" train.num_steps=$steps logging.dir=/tmp/runs/$name "${JOBARGS[@]}" "$@" > "$OUT/$name.log" 2>&1
    echo "$name: exit $?"
    cp /tmp/runs/$name/metrics.jsonl "$OUT/${name}_metrics.jsonl" 2>/dev/null
    cp /tmp/runs/$name/eval/metrics.jsonl "$OUT/${name}_eval.jsonl" 2>/dev/null  # runs that evaluate
    python - "$OUT/${name}_metrics.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])] if sys.argv[1] else []
keys = ["timing/step_s", "timing/train_s", "timing/rollout_s", "perf/images_per_s_per_gpu", "perf/mfu",
        "perf/rollout_busy_share", "perf/trainer_busy_share", "compile/trainer_new_frames",
        "compile/rollout_new_frames", "actor/ratio_dev_first_pass_max", "reward/mean"]
for r in rows:
    print(r["step"], " ".join(f"{k.split('/')[-1]}={r.get(k, float('nan')):.4g}" for k in keys))
PY
    ;;
esac
