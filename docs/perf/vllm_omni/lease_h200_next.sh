#!/bin/bash
# The next one-H200 lease (issues 53, 56, 55, then 54; order = priority, a lease of ~25 minutes reaches about the
# Wan benches): is cuDNN's attention backward right under the pinned torch 2.13
# (the trainer's check, docs/gpus.md), then FLUX.1's trainer bench and a 10-step job with the check in place (the
# eighth session's lease failed there), Wan2.1-1.3B at 480p (rollout benches side by side, a 10-step job), Z-Image's
# trainer bench again (its first ran with cuDNN's backward allowed) and the HTTP path under load on a Z-Image
# replica (issue 56, groups of 4), then cheaper ODE steps on Qwen-Image; the trainer bench with `model.compile.guards`
# full, then lean, on Z-Image and Qwen-Image (issue 54 point 1).
# On one GPU a job's replica and rank share it (half each); FLUX's and Wan's jobs run smaller groups to fit the lease.
# On a 2-GPU machine put `@0` before `model:flux` and `@1` before `model:wan`: two lanes side by side.
V=docs/perf/vllm_omni/gpu_runs.sh
ONE_GPU="rollout.replica_num_gpus=0.5 cluster.worker_num_gpus=0.5"
exec bash docs/perf/kernels/lease.sh start RUNS=$V setup sdpacheck \
  model:flux "EXTRA=rollout.group_size=8 train.micro_batch_size=8" BENCH_TIMEOUT=400 trainstep:flux \
  JOB_TIMEOUT=480 RETRY_NOCUDNN=1 "JOBARGS=$ONE_GPU train.groups_per_step=1" job:flux,f_v,10 RETRY_NOCUDNN=0 EXTRA= \
  model:z_image "EXTRA=rollout.group_size=4 train.micro_batch_size=4" BENCH_TIMEOUT=420 serving:z_image EXTRA= \
  model:wan "EXTRA=rollout.group_size=4 train.micro_batch_size=4" BENCH_TIMEOUT=300 bench:wan,vllm_omni,eager \
  bench:wan,local,eager JOB_TIMEOUT=540 "JOBARGS=$ONE_GPU train.groups_per_step=1" job:wan,w_v,10 EXTRA= \
  TEST_FILES=tests/models/test_attention.py TESTS_TIMEOUT=180 tests \
  model:z_image BENCH_TIMEOUT=300 trainstep:z_image EXTRA=model.compile.guards=lean trainstep:z_image EXTRA= \
  model:qwen_image ODE_GROUPS=8 THRESHOLDS= BENCH_TIMEOUT=500 odesteps:qwen_image BENCH_TIMEOUT=300 trainstep:qwen_image \
  EXTRA=model.compile.guards=lean trainstep:qwen_image
