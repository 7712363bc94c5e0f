#!/bin/bash
# The next one-H200 lease (issues 53, 56, 55, then 54; order = priority: a lease of ~25 minutes after carrying reaches
# about the Wan job). First the trainer's cuDNN check at a trainer's shape (torch 2.13's cuDNN backward is wrong in
# diffusers' layout at FLUX.1's shapes, right at the check's first small one: docs/gpus.md), then the HTTP path at 64
# concurrent clients on a Z-Image replica (issue 56; 1, 4 and 16 are in lease7), Wan2.1-1.3B at 480p (rollout benches
# side by side, a 10-step job; issue 55), FLUX.1's trainer bench with the check in place (no kernel list given), then
# issue 54: Z-Image's and Qwen-Image's trainer benches with `model.compile.guards` full, then lean, and cheaper ODE
# steps on Qwen-Image.
# On one GPU a job's replica and rank share it (half each); Wan's job runs groups of 4 to fit the lease.
# On a 2-GPU machine put `@0` before `model:z_image` and `@1` before `model:wan`: two lanes side by side.
V=docs/perf/vllm_omni/gpu_runs.sh
ONE_GPU="rollout.replica_num_gpus=0.5 cluster.worker_num_gpus=0.5"
exec bash docs/perf/kernels/lease.sh start RUNS=$V setup TEST_FILES=tests/models/test_attention.py TESTS_TIMEOUT=180 \
  tests model:z_image "EXTRA=rollout.group_size=4 train.micro_batch_size=4" BENCH_TIMEOUT=330 CLIENTS=64 \
  serving:z_image EXTRA= \
  model:wan "EXTRA=rollout.group_size=4 train.micro_batch_size=4" BENCH_TIMEOUT=300 bench:wan,vllm_omni,eager \
  bench:wan,local,eager JOB_TIMEOUT=540 "JOBARGS=$ONE_GPU train.groups_per_step=1" job:wan,w_v,10 EXTRA= \
  model:flux "EXTRA=rollout.group_size=8 train.micro_batch_size=8" BENCH_TIMEOUT=400 trainstep:flux EXTRA= \
  model:z_image BENCH_TIMEOUT=300 trainstep:z_image EXTRA=model.compile.guards=lean trainstep:z_image EXTRA= \
  model:qwen_image BENCH_TIMEOUT=300 trainstep:qwen_image EXTRA=model.compile.guards=lean trainstep:qwen_image EXTRA= \
  ODE_GROUPS=8 THRESHOLDS= BENCH_TIMEOUT=500 odesteps:qwen_image
