#!/bin/bash
# A short lease (what a session's device time left after machines failed to start, 2026-12-07): Wan2.1-T2V-1.3B's
# rollout bench on both engines side by side on one GPU (issue 55's row; lease 8's vllm-omni bench failed in its
# recompute check, fixed in 9176cec), groups of 4 at 832x480, 33 frames, 20 steps, CFG 5.
V=docs/perf/vllm_omni/gpu_runs.sh
exec bash docs/perf/kernels/lease.sh start RUNS=$V setup \
  model:wan "EXTRA=rollout.group_size=4 train.micro_batch_size=4" BENCH_TIMEOUT=300 \
  bench:wan,vllm_omni,eager bench:wan,local,eager
