#!/bin/bash
# Issue 51's 4-GPU lease (2026-11-28, sixth session): after the carried stack's install, one lane on all four GPUs runs
# the loop side by side (the diffusers engine's best 4-GPU placement, then the same with vllm-omni replicas), then one
# lane a GPU runs the one-GPU stages still missing (Qwen-Image merged, BAGEL's two-stage deploy timed, BAGEL compiled in
# our engine, the engine tests with the thinker's time). In the project root, PYTHONPATH set: bash this; then lease.sh wait.
J="train.max_staleness=1 train.groups_per_step=4 rollout.num_replicas=2 cluster.num_workers=2
   train.reshard_after_forward=false train.gradient_checkpointing=false train.activation_memory_budget=0.25"
J=$(echo $J)
V=docs/perf/vllm_omni/gpu_runs.sh
exec bash docs/perf/kernels/lease.sh start \
  RUNS=$V setup model:qwen_image \
  RUNS=docs/perf/scale/gpu_runs.sh MODEL=/tmp/models/qwen_image build \
  "JOBARGS=$J" "job:d_2p2 10" "JOBARGS=$J rollout.engine=vllm_omni" "job:v_2p2 10" \
  @0 RUNS=$V BENCH_TIMEOUT=300 bench:qwen_image,vllm_omni,merged \
  @1 RUNS=$V MODELS=/tmp/mb1 model:bagel BENCH_TIMEOUT=560 bench:bagel,vllm_omni,thinker \
  @2 RUNS=$V TESTS_TIMEOUT=480 tests LOOP_TIMEOUT=300 loop:thinker \
  @3 RUNS=$V MODELS=/tmp/mb3 model:bagel BENCH_TIMEOUT=300 bench:bagel,local,best
