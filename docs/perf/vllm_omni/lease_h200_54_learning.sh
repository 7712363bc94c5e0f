#!/bin/bash
# Issue 54 point 3 at real size on one GPU: FP8 ODE steps outside the SDE window against the model's precision.
# Z-Image-Turbo's recipe (6 steps, one SDE step a group among steps 1-3: five cheaper ODE steps), random weights of
# the real size, the JPEG reward (random weights learn it; they score 0 in OCR), the diffusers engine compiled
# (rollout.ode_steps is the in-process engines'), a replica and an FSDP2 rank sharing the GPU.
# History: lease 10 (one H100) ran one group of 16 a step at lr 1e-3, lease 11 (one H100) at the recipe's 3e-4, both
# with the recipe's LoRA on every block's attention and MLP: no run learned (the trained runs ended 1.5-2.7 below
# lr 0 at 3e-4, swinging by several units: a random transformer's blocks turn a small change of theirs into a large,
# undirected change of the image), so neither could show whether FP8 changes learning. As the tiny Z-Image, SD3 and
# FLUX learn (tests/train/test_z_image_learning.py), the LoRA now adapts the final projection only (the block layers
# FP8 multiplies stay frozen; the images still come from FP8 ODE steps), lr 1e-3, one group of 16 a step, 30 steps:
# the model's precision, FP8 and lr 0 on train.seed 0 (the same prompts and noise each step), then the same three on
# seed 1 (the run-to-run spread FP8's gain over lr 0 is held against), about 4 minutes a job alone. On an H200 the
# jobs run two at a time (gpu_runs.sh's BESIDE=1 and joinjobs: one's start-up beside the other's steps, two local
# Ray clusters; their step times are then not one job's); on an H100 one after another. Then, if the lease
# still runs, the bench (the advantages' agreement; FP8's speed-up without a remaking of its weights every group)
# and one linear layer at Z-Image's shapes, bf16 against FP8's ways (where FP8's speed goes), then the bench with
# FP8's fast accumulation and with tensorwise scales (rollout.ode_steps.fp8_fast_accum, fp8_scaling).
# A job the lease's end cuts still brings its metrics home (lease.sh packs runs/ at each wait).
# Verdict and picture: python docs/perf/ode_steps/plot_learning.py FOLDER
V=docs/perf/vllm_omni/gpu_runs.sh
W="rollout.sde_window.size=1 rollout.sde_window.range=[1,4]" F=rollout.ode_steps.precision=fp8
C="rollout.replica_num_gpus=0.5 cluster.worker_num_gpus=0.5 rollout.engine=diffusers train.groups_per_step=1"
C="$C train.learning_rate=1e-3 model.lora_target_modules=[all_final_layer.2-1.linear]"
exec bash docs/perf/kernels/lease.sh start RUNS=$V setup model:z_image JOB_TIMEOUT=600 \
  BESIDE=1 "JOBARGS=$C" job:z_image,ode_model,30 "JOBARGS=$C train.learning_rate=0" job:z_image,ode_lr0,30 joinjobs \
  "JOBARGS=$C rollout.ode_steps.precision=fp8" job:z_image,ode_fp8,30 "JOBARGS=$C train.seed=1" \
  job:z_image,ode_model_seed1,30 joinjobs "JOBARGS=$C train.seed=1 train.learning_rate=0" job:z_image,ode_lr0_seed1,30 \
  "JOBARGS=$C train.seed=1 rollout.ode_steps.precision=fp8" job:z_image,ode_fp8_seed1,30 joinjobs BESIDE=0 \
  ODE_GROUPS=4 THRESHOLDS= BENCH_TIMEOUT=400 "EXTRA=$W" odesteps:z_image EXTRA= BENCH_TIMEOUT=240 \
  fp8linear:z_image BENCH_TIMEOUT=400 "EXTRA=$W $F rollout.ode_steps.fp8_fast_accum=true" odesteps:z_image \
  "EXTRA=$W $F rollout.ode_steps.fp8_scaling=tensorwise" odesteps:z_image
