#!/bin/bash
# The compiled fast path measured side by side on one lent GPU (one call of the device tool per stage, back to back:
# the machine keeps /tmp only while calls follow each other). Run in the project root with PYTHONPATH set:
#   bash docs/perf/compiled/gpu_runs.sh STAGE
# Writes JSON lines and metrics into $OUT (the device tool's folder; ./out elsewhere).
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
MODEL=/tmp/qwen-image-full
CACHE=/tmp/compile_cache   # one inductor cache for every stage: later stages start warm where graphs repeat
CFG=configs/qwen_image_ocr_2gpu.yaml
COMPILED=(model.compile.cache_dir=$CACHE)   # the GPU config compiles, old log-probs from the trainer
EAGER=(model.compile.enabled=false train.old_logprob=rollout)   # as before the compiled path
FAST=(rollout.sde_window.size=2 "rollout.sde_window.range=[0,5]" train.timestep_fraction=1 train.max_staleness=1)
ONE_GPU=(rollout.replica_num_gpus=0.5 cluster.worker_num_gpus=0.5 train.groups_per_step=2)
JPEG=("reward.weights={jpeg_compressibility: 1.0}" train.seed=0 train.checkpoint_every=0 logging.image_every=0)
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1

case "$1" in
  build)  # the real-size random Qwen-Image (60 blocks, 20.4B, bf16) and the GPU tests of the compiled path
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/device.txt"
    python -m jobs.make_tiny_models --preset qwen-image-full --out $MODEL 2>&1 | tail -2
    python -m pytest -q -p no:cacheprovider tests/train/test_compiled_gpu.py tests/train/test_policy_gpu.py -s \
      2>&1 | grep -E "compiled bf16|passed|failed|Error" | tee "$OUT/gpu_tests.txt" ;;
  train_step)  # the trainer's update, eager then compiled, one process each (config recipe: 2 of 10 steps trained)
    for mode in eager compiled; do
      extra=("${EAGER[@]}"); [ $mode = compiled ] && extra=("${COMPILED[@]}")
      python -m jobs.bench_train_step --config $CFG --groups 2 --repeats 3 model.path=$MODEL "${extra[@]}" \
        2>/dev/null | tail -1 | tee -a "$OUT/bench_train_step.jsonl"
    done ;;
  rollout)  # a group of 8 at 512², CFG 4, 10 steps, eager then compiled
    for mode in eager compiled; do
      extra=("${EAGER[@]}"); [ $mode = compiled ] && extra=("${COMPILED[@]}")
      python -m jobs.bench_rollout --config $CFG --groups 2 --repeats 3 --batched-only model.path=$MODEL "${extra[@]}" \
        2>/dev/null | tail -1 | tee -a "$OUT/bench_rollout.jsonl"
    done ;;
  job_*)  # jobs.train, the fast recipe on one GPU: job_compiled, job_compiled_lr0, job_eager [steps] [lr]
    name=${1#job_}; steps=${2:-16}; lr=${3:-1e-3}
    extra=("${COMPILED[@]}"); [ "$name" = eager ] && extra=("${EAGER[@]}")
    [ "$name" = compiled_lr0 ] && lr=0
    timeout ${JOB_TIMEOUT:-540} python -m jobs.train --config $CFG model.path=$MODEL "${FAST[@]}" "${ONE_GPU[@]}" \
      "${JPEG[@]}" "${extra[@]}" \
      train.num_steps=$steps train.learning_rate=$lr logging.dir=/tmp/runs/$name > "$OUT/job_$name.log" 2>&1
    echo "exit $?"; cp /tmp/runs/$name/metrics.jsonl "$OUT/job_${name}_metrics.jsonl"
    tail -5 "$OUT/job_$name.log" ;;
esac
