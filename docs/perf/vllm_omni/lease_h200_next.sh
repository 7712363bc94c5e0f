#!/bin/bash
# The next one-H200 lease (issues 53, 55, 54; order = priority). Lease 8 did the GPU tests and 64 clients (issue 56),
# Wan's diffusers bench and 8 of the job's 10 steps. Now: FLUX.1's trainer bench (a trainer leaves cuDNN's attention
# out by default since lease 8), Wan on vllm-omni (its recompute's dtype fixed) and its 10-step job with room (step 1
# took 156 s, the others 41 s, start-up ~90 s), then issue 54: Z-Image's and Qwen-Image's trainer benches with
# `model.compile.guards` full, then lean, and cheaper ODE steps on Qwen-Image.
# On one GPU a job's replica and rank share it (half each); Wan's job runs groups of 4 to fit the lease.
# On a 2-GPU machine put `@0` before `model:flux` and `@1` before `model:wan`: two lanes side by side.
V=docs/perf/vllm_omni/gpu_runs.sh
ONE_GPU="rollout.replica_num_gpus=0.5 cluster.worker_num_gpus=0.5"
exec bash docs/perf/kernels/lease.sh start RUNS=$V setup \
  model:flux "EXTRA=rollout.group_size=8 train.micro_batch_size=8" BENCH_TIMEOUT=400 trainstep:flux EXTRA= \
  model:wan "EXTRA=rollout.group_size=4 train.micro_batch_size=4" BENCH_TIMEOUT=300 bench:wan,vllm_omni,eager \
  JOB_TIMEOUT=720 "JOBARGS=$ONE_GPU train.groups_per_step=1" job:wan,w_v,10 EXTRA= \
  model:z_image BENCH_TIMEOUT=300 trainstep:z_image EXTRA=model.compile.guards=lean trainstep:z_image EXTRA= \
  model:qwen_image BENCH_TIMEOUT=300 trainstep:qwen_image EXTRA=model.compile.guards=lean trainstep:qwen_image EXTRA= \
  ODE_GROUPS=8 THRESHOLDS= BENCH_TIMEOUT=500 odesteps:qwen_image
