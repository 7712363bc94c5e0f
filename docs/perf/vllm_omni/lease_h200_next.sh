#!/bin/bash
# The next one-GPU lease (issue 54; order = priority). Lease 9 (one H100, 2026-12-07) measured Wan on both engines,
# its 10-step job (issue 55) and Z-Image's trainer bench with guards full / lean / skip (29.17 / 29.10 / 29.12 % MFU:
# not the lever); it ended in Qwen-Image's first trainer bench. Now: Qwen-Image's trainer bench with guards full and
# skip (60 blocks, twice Z-Image's), then cheaper ODE steps on Qwen-Image. Send the first device call alone, naming the
# kind (docs/perf/vllm_omni/README.md).
V=docs/perf/vllm_omni/gpu_runs.sh
exec bash docs/perf/kernels/lease.sh start RUNS=$V setup \
  model:qwen_image BENCH_TIMEOUT=300 trainstep:qwen_image EXTRA=model.compile.guards=skip trainstep:qwen_image EXTRA= \
  ODE_GROUPS=8 THRESHOLDS= BENCH_TIMEOUT=500 odesteps:qwen_image
