#!/bin/bash
# SD3.5-Medium at its real size (random weights) on one lent GPU: the figures of docs/model_families.md "Stable Diffusion 3" and
# issue 26's point 5, side by side with flow_grpo's ≈ 0.83 img/s/GPU (its OCR recipe, flow_grpo #96). One device
# call per stage, back to back (the machine keeps /tmp only while calls follow each other). In the project root,
# with the device wheels installed and PYTHONPATH set:
#   bash docs/perf/sd3/gpu_runs.sh STAGE
# Stages: build (the checkpoint, ~20 GB, and the bf16 parity test), rollout, train_step, job_full, job_fast, cache, pack.
# A compiled start from an earlier machine's cache (issue 36 point 6): `job_fast 3` then `pack` on one lease; on the
# next (a fresh machine), with .devcache/compile_cache_sd3.tgz carried (`carry: [".devcache"]`), `build` seeds
# /tmp/compile_cache from it and `job_fast 3` again: step 1 cold against step 1 warm, the cache counters beside.
# The GPU image has no vllm: the rollout runs on the diffusers engine. Eager and compiled run in the same call.
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
MODEL=/tmp/sd35m
CACHE=/tmp/compile_cache
PATHS=(model.path=$MODEL data.prompts=ocr_tiny rollout.engine=diffusers)
EAGER=(model.compile.enabled=false train.old_logprob=rollout)
COMPILED=(model.compile.cache_dir=$CACHE)
# both halves on one GPU: one rollout replica and one training worker, half the GPU each; the reward on CPUs
ONE_GPU=(cluster.address=null rollout.num_replicas=1 rollout.replica_num_gpus=0.5 rollout.replica_num_cpus=2 cluster.num_workers=1
         cluster.worker_num_gpus=0.5 reward.num_replicas=2 reward.replica_num_cpus=2 train.groups_per_step=2 train.checkpoint_every=0
         logging.image_every=0 eval.every=0)
MODES=${MODES:-eager compiled}   # the benches' modes, one process each; MODES=compiled saves device time
# issue 36's levers on the benches: EXTRA="key=value ..." adds overrides (e.g. train.gradient_checkpointing=false
# train.activation_memory_budget=0.25, or rollout.merge_lora=true), FLAGS="--adapter --profile $OUT/p.json" options
read -r -a EXTRA <<< "${EXTRA:-}"; read -r -a FLAGS <<< "${FLAGS:-}"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1

case "$1" in
  build)
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/device.txt"
    seed=${SEED_CACHE:-.devcache/compile_cache_sd3.tgz}
    [ -f $seed ] && tar xzf $seed -C /tmp && echo "compile cache seeded from $seed: $(du -sh $CACHE | cut -f1)"
    python -m jobs.make_tiny_models --preset sd35-medium --out $MODEL 2>&1 | tail -1
    SD35M_PATH=$MODEL python -m pytest -q -p no:cacheprovider tests/train/test_sd3_real_size_gpu.py -s 2>&1 \
      | grep -E "mismatch|passed|failed|Error" | tee "$OUT/gpu_tests.txt" ;;
  rollout)  # groups of 24 at 512², CFG 4.5, 10 steps (the recipe), eager then compiled
    for mode in $MODES; do
      extra=("${EAGER[@]}"); [ $mode = compiled ] && extra=("${COMPILED[@]}")
      timeout ${BENCH_TIMEOUT:-300} python -m jobs.bench_rollout --config configs/sd35m_ocr.yaml --groups 2 --repeats 3 --batched-only \
        "${FLAGS[@]}" "${PATHS[@]}" "${extra[@]}" "${EXTRA[@]}" 2>"$OUT/$1_$mode.err" | tail -1 | tee -a "$OUT/bench_rollout.jsonl"
    done; tail -n 4 "$OUT"/$1_*.err ;;
  train_step)  # one group of 24, 9 of 10 steps trained, CFG 4.5, KL, checkpointing: eager then compiled
    for mode in $MODES; do
      extra=("${EAGER[@]}"); [ $mode = compiled ] && extra=("${COMPILED[@]}")
      timeout ${BENCH_TIMEOUT:-420} python -m jobs.bench_train_step --config configs/sd35m_ocr.yaml --groups 1 \
        --repeats ${REPEATS:-3} "${FLAGS[@]}" \
        "${PATHS[@]}" "${extra[@]}" "${EXTRA[@]}" 2>"$OUT/$1_$mode.err" | tail -1 | tee -a "$OUT/bench_train_step.jsonl"
    done; tail -n 4 "$OUT"/$1_*.err ;;
  job_full|job_fast)  # jobs.train, the recipe on one GPU: s/step, img/s/GPU, effective MFU, first-pass ratio
    # (job_fast STEPS [OVERRIDE ...]: overrides after the one-GPU placement; NAME= names the run's files)
    config=configs/sd35m_ocr.yaml; [ "$1" = job_fast ] && config=configs/sd35m_ocr_fast.yaml
    mode=("${COMPILED[@]}"); [ "${MODE:-compiled}" = eager ] && mode=("${EAGER[@]}")
    name=${NAME:-$1}
    timeout ${JOB_TIMEOUT:-540} python -m jobs.train --config $config "${PATHS[@]}" "${ONE_GPU[@]}" \
      "${mode[@]}" train.num_steps=${2:-8} logging.dir=/tmp/runs/$name "${@:3}" > "$OUT/$name.log" 2>&1
    echo "exit $?"; cp /tmp/runs/$name/metrics.jsonl "$OUT/${name}_metrics.jsonl"; cp /tmp/runs/$name/config.yaml "$OUT/${name}_config.yaml"
    tail -5 "$OUT/$name.log"
    python -c "import json,sys
for line in open(sys.argv[1]):
    m = json.loads(line); print({k: round(v, 4) for k, v in m.items() if k in ('step', 'timing/step_s', 'timing/rollout_s',
        'timing/train_s', 'perf/images_per_s', 'perf/images_per_s_per_gpu', 'perf/mfu', 'perf/gpu_idle_share', 'actor/ratio_dev_first_pass_max', 'reward/mean', 'timing/reward_wait_s_max', 'perf/reward_busy_s') or k.startswith('compile/')})" \
      "$OUT/${name}_metrics.jsonl" ;;
  cache)  # the fast recipe's trainer bench cold, then in a new process given a copy of that cache at another path,
    # the machine's own caches wiped (a fresh machine the folder was carried to): hits, misses and bypasses
    rm -rf /tmp/ccA /tmp/ccB /tmp/torchinductor_* ~/.triton ~/.cache/triton
    for run in cold warm_copied; do
      dir=/tmp/ccA; [ $run = warm_copied ] && { cp -r /tmp/ccA /tmp/ccB; rm -rf /tmp/torchinductor_* ~/.triton; dir=/tmp/ccB; }
      timeout ${BENCH_TIMEOUT:-300} python -m jobs.bench_train_step --config configs/sd35m_ocr_fast.yaml --groups 1 \
        --repeats 2 "${PATHS[@]}" model.compile.cache_dir=$dir "${EXTRA[@]}" 2>"$OUT/cache_$run.err" | tail -1 \
        | sed "s/^{/{\"variant\": \"$run\", /" | tee -a "$OUT/bench_cache.jsonl"
    done; tail -n 2 "$OUT"/cache_*.err ;;
  pack)  # this lease's inductor cache, for a later (fresh) machine: copy it to .devcache/ and carry it
    # in parts under the 16 MiB a returned file may have (17 MB packed): `cat compile_cache_sd3.tgz.part* > .devcache/compile_cache_sd3.tgz`
    tar czf - -C /tmp compile_cache | split -b 15m - "$OUT/compile_cache_sd3.tgz.part" && du -ch "$OUT"/*.part* ;;
esac
