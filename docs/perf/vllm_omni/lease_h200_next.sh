#!/bin/bash
# The next one-GPU lease (issue 54, point 1; order = priority). Lease 9 (one H100, 2026-12-07) measured Wan on both
# engines, its 10-step job (issue 55) and Z-Image's trainer bench with guards full / lean / skip (29.17 / 29.10 /
# 29.12 % MFU: not the lever); it ended in Qwen-Image's first trainer bench. Now Qwen-Image's trainer bench: the best
# known settings (activation budget 0.25: 30.9 % on an H100, 32.0 % on an H200), the same with guards skipped (60
# blocks, twice Z-Image's), then less recomputation (budget 0.5 at micro-batches of 4; an H100 may run out of memory),
# then cheaper ODE steps on Qwen-Image (group of 8, CFG 4: the bench now gives each setting's effective MFU, point
# 2's figure with FP8 ODE steps beside the model precision's). The first two profile one more micro-batch: what
# binds under torch 2.13 (the profile of 2026-11-27 was torch 2.11's). First, 2 minutes: one linear layer at both families' block shapes, bf16
# against FP8's ways (docs/perf/ode_steps/fp8_linear_bench.py), unless the learning lease already brought it. Send the first device call alone, naming the kind (docs/perf/vllm_omni/README.md).
V=docs/perf/vllm_omni/gpu_runs.sh
B="train.gradient_checkpointing=false train.activation_memory_budget"
exec bash docs/perf/kernels/lease.sh start RUNS=$V setup fp8linear model:qwen_image BENCH_TIMEOUT=360 PROFILE=1 \
  "EXTRA=$B=0.25" trainstep:qwen_image "EXTRA=$B=0.25 model.compile.guards=skip" trainstep:qwen_image PROFILE=0 \
  "EXTRA=$B=0.5 train.micro_batch_size=4" trainstep:qwen_image EXTRA= \
  ODE_GROUPS=8 THRESHOLDS= BENCH_TIMEOUT=500 odesteps:qwen_image
