#!/bin/bash
# The OCR reward on a GPU (issue 35 point 3) on one lent GPU: the reader's throughput on the CPUs against the GPU,
# then the SD3.5-Medium fast recipe (compiled, both halves on the GPU) with the OCR reward on CPUs (before) and on
# a GPU share (after), one after another in the same lease. One device call per stage, back to back; in the
# project root with the device wheels installed and PYTHONPATH set:
#   bash docs/perf/reward/gpu_ocr.sh setup | before | after
# The GPU image has no vllm: the rollout runs on the diffusers engine.
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
RUNS=docs/perf/sd3/gpu_runs.sh
STEPS=${STEPS:-7}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
case "$1" in
  setup)  # the checkpoint (random weights, SD3.5-M's size), then the reader alone: 48 rendered 512² signs
    bash $RUNS build
    timeout 240 python -m jobs.bench_ocr --device cpu cuda --threads 1 4 --images 48 --size 512 2>"$OUT/bench_ocr.err" \
      | tail -1 | tee -a "$OUT/bench_ocr.jsonl"; tail -n 3 "$OUT/bench_ocr.err" ;;
  before)  # as docs/perf/sd3 ran it: 2 reward replicas of 2 CPUs, one onnxruntime engine per CPU
    NAME=ocr_cpu bash $RUNS job_fast $STEPS reward.num_replicas=2 reward.replica_num_cpus=2 ;;
  after)  # one reward replica with a tenth of the GPU (the networks on torch there) and 4 CPUs for the rest
    NAME=ocr_gpu bash $RUNS job_fast $STEPS rollout.replica_num_gpus=0.45 cluster.worker_num_gpus=0.45 \
      reward.num_replicas=1 reward.replica_num_cpus=4 reward.replica_num_gpus=0.1 ;;
esac
