#!/bin/bash
# Issue 54 point 3 at real size on one H200: FP8 ODE steps outside the SDE window against the model's precision.
# Z-Image-Turbo's recipe (6 steps, one SDE step a group among steps 1-3: five cheaper ODE steps), random weights of
# the real size, the JPEG reward (random weights learn it), the diffusers engine compiled (rollout.ode_steps is
# the in-process engines'), a replica and an FSDP2 rank sharing the GPU: first the bench (speed-up and the reward's
# distribution over 4 groups of 16 images, the same seeds), then 30 steps each of bf16, FP8 and lr 0 (same seeds:
# the same prompts and noise). Picture: python docs/perf/ode_steps/plot_learning.py FOLDER
V=docs/perf/vllm_omni/gpu_runs.sh
COMMON="rollout.replica_num_gpus=0.5 cluster.worker_num_gpus=0.5 rollout.engine=diffusers"
exec bash docs/perf/kernels/lease.sh start RUNS=$V setup model:z_image ODE_GROUPS=4 THRESHOLDS= BENCH_TIMEOUT=400 \
  odesteps:z_image JOB_TIMEOUT=560 "JOBARGS=$COMMON" job:z_image,ode_model,30 \
  "JOBARGS=$COMMON rollout.ode_steps.precision=fp8" job:z_image,ode_fp8,30 \
  "JOBARGS=$COMMON train.learning_rate=0" job:z_image,ode_lr0,30
