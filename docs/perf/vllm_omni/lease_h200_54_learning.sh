#!/bin/bash
# Issue 54 point 3 at real size on one GPU: FP8 ODE steps outside the SDE window against the model's precision.
# Z-Image-Turbo's recipe (6 steps, one SDE step a group among steps 1-3: five cheaper ODE steps), random weights of
# the real size, the JPEG reward (random weights learn it; they score 0 in OCR), the diffusers engine compiled
# (rollout.ode_steps is the in-process engines'), a replica and an FSDP2 rank sharing the GPU: first the bench
# (speed-up and the reward's distribution over 4 groups of 16 images, the same seeds), then 30 steps each of the
# model's precision, FP8 and lr 0 (train.seed 0: the same prompts and noise each step), then the model's precision
# on another seed (the run-to-run spread the FP8 run is held against). To fit one 30-minute lease a step trains one
# group of 16 (the recipe: two). Lease 10 (one H100, 2026-12-07) ran this at lr 1e-3: both trained runs fell first
# and then swung by ±7 (too high a rate for a steady curve); and its FP8 rollout ran eager past dynamo's limit in
# the replica's sampling thread (fixed since: app/models/compile.py, app/rollout/ode_steps.py). Now the recipe's lr.
# The jobs first (lease 10 brought the bench's reward distribution; a 30-minute lease fits about four jobs), then
# the bench again (the fixed FP8 path's speed-up, the denoising alone) and Z-Image's trainer bench with diffusers' complex RoPE and with the real one
# (model.compile.real_rope, since a5976fa): issue 54 point 1 on Z-Image. A job the lease's end cuts still brings its
# metrics home (lease.sh packs runs/ at each wait).
# Picture: python docs/perf/ode_steps/plot_learning.py FOLDER
V=docs/perf/vllm_omni/gpu_runs.sh
COMMON="rollout.replica_num_gpus=0.5 cluster.worker_num_gpus=0.5 rollout.engine=diffusers train.groups_per_step=1"
exec bash docs/perf/kernels/lease.sh start RUNS=$V setup model:z_image JOB_TIMEOUT=480 \
  "JOBARGS=$COMMON" job:z_image,ode_model,30 \
  "JOBARGS=$COMMON rollout.ode_steps.precision=fp8" job:z_image,ode_fp8,30 \
  "JOBARGS=$COMMON train.learning_rate=0" job:z_image,ode_lr0,30 \
  "JOBARGS=$COMMON train.seed=1" job:z_image,ode_model_seed1,30 \
  ODE_GROUPS=4 THRESHOLDS= BENCH_TIMEOUT=400 \
  "EXTRA=rollout.sde_window.size=1 rollout.sde_window.range=[1,4]" odesteps:z_image BENCH_TIMEOUT=300 \
  EXTRA=model.compile.real_rope=false trainstep:z_image EXTRA= trainstep:z_image
