#!/bin/bash
# Issue 54 point 3 at real size on one GPU: FP8 ODE steps outside the SDE window against the model's precision.
# Z-Image-Turbo's recipe (6 steps, one SDE step a group among steps 1-3: five cheaper ODE steps), random weights of
# the real size, the JPEG reward (random weights learn it; they score 0 in OCR), the diffusers engine compiled
# (rollout.ode_steps is the in-process engines'), a replica and an FSDP2 rank sharing the GPU.
# History: lease 10 (one H100) ran one group of 16 a step at lr 1e-3 (both trained runs fell, then swung by ±7) with
# the FP8 blocks eager in the sampling thread (0.63x; fixed); lease 11 (one H100) one group a step at the recipe's lr
# 3e-4: FP8 1.09x in the replica, but no run learned in 30 steps (16 images a step carry too little signal against a
# random transformer's swings; docs/perf/vllm_omni/lease11_h100_2026-12-07/).
# Now the recipe's two groups a step (32 images), 30 steps each of the model's precision, FP8 and lr 0 (train.seed 0:
# the same prompts and noise each step), about 6.5 minutes a job; then, if the lease still runs, the bench (the
# advantages' agreement: the learning signal from either setting's rewards on the same 64 images; FP8's speed-up now
# without a remaking of its weights every group) and one linear layer at Z-Image's shapes, bf16 against FP8's ways
# (rowwise, its GEMM alone, fast accumulation, tensorwise): where FP8's speed goes.
# A job the lease's end cuts still brings its metrics home (lease.sh packs runs/ at each wait).
# Picture: python docs/perf/ode_steps/plot_learning.py FOLDER
V=docs/perf/vllm_omni/gpu_runs.sh
COMMON="rollout.replica_num_gpus=0.5 cluster.worker_num_gpus=0.5 rollout.engine=diffusers"
exec bash docs/perf/kernels/lease.sh start RUNS=$V setup model:z_image JOB_TIMEOUT=540 \
  "JOBARGS=$COMMON" job:z_image,ode_model,30 \
  "JOBARGS=$COMMON rollout.ode_steps.precision=fp8" job:z_image,ode_fp8,30 \
  "JOBARGS=$COMMON train.learning_rate=0" job:z_image,ode_lr0,30 \
  ODE_GROUPS=4 THRESHOLDS= BENCH_TIMEOUT=400 \
  "EXTRA=rollout.sde_window.size=1 rollout.sde_window.range=[1,4]" odesteps:z_image EXTRA= BENCH_TIMEOUT=240 \
  fp8linear:z_image
