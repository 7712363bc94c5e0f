#!/bin/bash
# Issue 51's 2-GPU lease (2026-11-28, seventh session): what the 4-GPU lease lost when its machine went back, one lane
# a GPU after the carried stack's install. GPU 0: BAGEL's thinker test on CUDA, trained steps of the tiny BAGEL on the
# two-stage deploy, then the compiled diffusers engine on real-size Qwen-Image. GPU 1: BAGEL's two-stage deploy timed at
# its real width, then Qwen-Image on vllm-omni compiled with the adapter folded in (the pair side by side, one machine).
# In the project root, PYTHONPATH set: bash this; then lease.sh wait (one last wait covering every stage).
V=docs/perf/vllm_omni/gpu_runs.sh
exec bash docs/perf/kernels/lease.sh start \
  RUNS=$V setup \
  @0 RUNS=$V TEST_FILES=tests/rollout/test_bagel_thinker.py TESTS_TIMEOUT=360 tests LOOP_TIMEOUT=300 loop:thinker \
     MODELS=/tmp/m0 model:qwen_image BENCH_TIMEOUT=300 bench:qwen_image,local,best \
  @1 RUNS=$V MODELS=/tmp/m1 model:bagel BENCH_TIMEOUT=500 bench:bagel,vllm_omni,thinker \
     model:qwen_image BENCH_TIMEOUT=450 bench:qwen_image,vllm_omni,merged
