#!/bin/bash
# Issue 53's lease on one H200 (2026-11-29, eighth session: only one-GPU machines lent): Z-Image and FLUX.1-dev at
# their real size (random weights), vllm-omni beside the diffusers engine, eager; the trainer's compiled update; a
# jobs.train run of 10 steps each on the one GPU, a vllm-omni replica and one FSDP2 rank sharing it (half a GPU each).
# FLUX's trainer runs groups of 8 (its recipe's 24 x 2 groups would take about 100 s a step here).
# In the project root, PYTHONPATH set: bash this; then lease.sh wait (in the same batch of calls as the carrying).
V=docs/perf/vllm_omni/gpu_runs.sh
ONE_GPU="rollout.replica_num_gpus=0.5 cluster.worker_num_gpus=0.5"
exec bash docs/perf/kernels/lease.sh start RUNS=$V setup \
  model:z_image BENCH_TIMEOUT=300 bench:z_image,vllm_omni,eager bench:z_image,local,eager trainstep:z_image \
  JOB_TIMEOUT=420 "JOBARGS=$ONE_GPU" job:z_image,z_v,10 \
  model:flux bench:flux,vllm_omni,eager bench:flux,local,eager \
  "EXTRA=rollout.group_size=8 train.micro_batch_size=8" trainstep:flux \
  JOB_TIMEOUT=480 "JOBARGS=$ONE_GPU train.groups_per_step=1" job:flux,f_v,10
