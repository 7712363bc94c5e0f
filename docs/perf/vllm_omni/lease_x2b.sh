#!/bin/bash
# The second 2-GPU lease of the seventh session (the first went back between its two calls): Qwen-Image at real size,
# compiled, one lane a GPU side by side: GPU 0 the diffusers engine, then cheaper ODE steps (issue 54); GPU 1
# vllm-omni with the adapter folded in. Then lease.sh wait, in the same batch of calls as the carrying.
V=docs/perf/vllm_omni/gpu_runs.sh
exec bash docs/perf/kernels/lease.sh start \
  @0 RUNS=$V MODELS=/tmp/m0 model:qwen_image BENCH_TIMEOUT=300 bench:qwen_image,local,best \
     ODE_GROUPS=4 "THRESHOLDS=0.05 0.1" BENCH_TIMEOUT=400 odesteps:qwen_image \
  @1 RUNS=$V MODELS=/tmp/m1 model:qwen_image BENCH_TIMEOUT=480 bench:qwen_image,vllm_omni,merged
