#!/bin/bash
# The next one-H200 lease (issues 55, 54; order = priority). Lease 8 did the GPU tests and 64 clients (issue 56),
# Wan's diffusers bench and 8 of the job's 10 steps; FLUX.1's trainer row is lease 7's (33.2 % MFU without cuDNN's
# attention, which a trainer now leaves out by default). Now: Wan on both engines side by side (vllm-omni's recompute
# dtype fixed in 9176cec; 33 frames, the config's), its 10-step job with room (step 1 took 156 s, the others 41 s,
# start-up ~90 s), then issue 54: Z-Image's and Qwen-Image's trainer benches with `model.compile.guards` full, then
# lean, then skip, and cheaper ODE steps on Qwen-Image. Send the first device call alone (docs/perf/vllm_omni/README.md).
# On one GPU a job's replica and rank share it (half each); Wan's job runs groups of 4 to fit the lease.
V=docs/perf/vllm_omni/gpu_runs.sh
ONE_GPU="rollout.replica_num_gpus=0.5 cluster.worker_num_gpus=0.5"
exec bash docs/perf/kernels/lease.sh start RUNS=$V setup \
  model:wan "EXTRA=rollout.group_size=4 train.micro_batch_size=4" BENCH_TIMEOUT=300 bench:wan,vllm_omni,eager \
  bench:wan,local,eager \
  JOB_TIMEOUT=720 "JOBARGS=$ONE_GPU train.groups_per_step=1" job:wan,w_v,10 EXTRA= \
  model:z_image BENCH_TIMEOUT=300 trainstep:z_image EXTRA=model.compile.guards=lean trainstep:z_image \
  EXTRA=model.compile.guards=skip trainstep:z_image EXTRA= \
  model:qwen_image BENCH_TIMEOUT=300 trainstep:qwen_image EXTRA=model.compile.guards=lean trainstep:qwen_image \
  EXTRA=model.compile.guards=skip trainstep:qwen_image EXTRA= \
  ODE_GROUPS=8 THRESHOLDS= BENCH_TIMEOUT=500 odesteps:qwen_image
