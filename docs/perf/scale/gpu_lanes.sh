#!/bin/bash
# Two runs at a time on one lent 4-GPU machine: two "lanes" of 2 GPUs, each its own local Ray cluster
# (CUDA_VISIBLE_DEVICES, RAY_TMPDIR, the Serve port), each running gpu_runs.sh stages one after another. The lanes
# outlive the device tool's call (setsid): `start` returns at once, `wait S [a|b|q]` sleeps up to S seconds (or
# until that part is done) and packs what is done into $OUT/lanes.tgz, `collect` packs only. GPU figures: the
# diffusers engine.
# Once both lanes are done, `quad` runs on all four GPUs one after another (its own cluster).
#   bash docs/perf/scale/gpu_lanes.sh start [quad|learn4|pair2] | wait 540 [a|b|q|p] | collect
#   (issue 54 point 4: on 4 GPUs LANES=0 QUAD_RUNS="q_2p2_keep_budget q_2p2_keep_budget_fp8" ... start quad; on 2
#   GPUs start pair2, then wait ... p)
#   (4-GPU runs alone, as lease7b_4xh200/: LANES=0 BENCH_EXPORT=0 QUAD_RUNS="q_2p2_keep_budget ..." ... start quad)
#   (LANES=0: no 2-GPU lanes; QUAD_RUNS="...": which 4-GPU runs, in order; CHECK=1 NGPUS=4: a dry run on any
#   machine, every job's config loaded and nothing run)
# The lanes of a lease are this script's functions; git history has each lease's (docs/perf/scale/README.md).
# The inductor cache of every run (gpu_runs.sh's /tmp/compile_cache) goes home in $OUT/compile_cache_scale.tgz.part*; a
# later lease that carries it back (`carry: [".devcache"]`, the file at $SEED) starts its first steps warm.
set -uo pipefail
RES=/tmp/lanes; RUNS=${RUNS:-docs/perf/scale/gpu_runs.sh}  # CHECK=1: a dry run of the plan (gpu_runs.sh)
# a path carried in one call is gone in the next (the device tool replaces the carried paths at every call): the call
# that carries .devcache copies it to /tmp/seed.tgz, which `start` then finds
SEED=${SEED_CACHE:-.devcache/compile_cache_scale.tgz}; [ -f "$SEED" ] || SEED=/tmp/seed.tgz
source "${BASH_SOURCE%/*}/../cores.sh"
# the learning check (issue 34 point 4): 40 steps, the eval set's JPEG reward every 10 (16 held-out prompts,
# deterministic), before the first step too
LEARN=(train.max_staleness=1 eval.every=10 eval.before_train=true eval.prompts=ocr_eval eval.max_prompts=16)

lane() {  # lane GPUS NAME PORT: the environment of one lane, on its GPUs' share of the host's cores (the lanes'
  # compilations and rewards then leave each other's CPUs alone; docs/perf/cores.sh)
  export CUDA_VISIBLE_DEVICES=$1 RAY_TMPDIR=/tmp/ray_$2 OUT=$RES/$2 PORT=$3
  mkdir -p $RAY_TMPDIR $OUT
  local cores; cores=$(gpu_cores $1)
  taskset -cp "$cores" $$ > /dev/null && echo "lane $2: GPUs $1, cores $cores"
}
# 4 GPUs, the per-GPU load of the 2-GPU runs: 4 groups (32 images) a step; 1 + 3 takes 3 (groups divide over ranks)
QUAD=(train.max_staleness=1 train.groups_per_step=4)
# this lease's 2-GPU lanes, side by side before the 4-GPU runs: the weak-scaling baseline of the best 4-GPU recipe
# (the split, activation memory in place of checkpointing), and beside it the checkpointed split (the budget's
# 1.07x of 2026-11-27 again)
BUDGET=(train.gradient_checkpointing=false train.activation_memory_budget=0.25)
lane_a() { lane 0,1 a 8001; bash $RUNS job split_k1_budget 10 "${SPLIT[@]}" train.max_staleness=1 "${BUDGET[@]}" \
  cluster.serve_port=$PORT; }
lane_b() { lane 2,3 b 8002; bash $RUNS job split_k1 10 "${SPLIT[@]}" train.max_staleness=1 cluster.serve_port=$PORT; }
SPLIT=(rollout.num_replicas=1 cluster.num_workers=1)
FP8=(rollout.ode_steps.precision=fp8)  # the non-window steps in FP8 (issue 54 point 3: rollout.ode_steps)
pair2() {  # issue 54 point 4 on a 2-GPU machine: the best 2-GPU split, then the same with FP8 ODE steps, 10 steps
  # each, one after another on one machine (the ratio side by side)
  lane 0,1 p 8004
  for extra in "" "${FP8[*]}"; do
    bash $RUNS job split_k1_budget${extra:+_fp8} 10 "${SPLIT[@]}" train.max_staleness=1 "${BUDGET[@]}" \
      $extra cluster.serve_port=$PORT
  done
}
# the 4-GPU runs in order of what issue 38 needs first; a lease that runs out leaves the rest to the next one:
#   QUAD_RUNS="q_eager_2p2" bash gpu_lanes.sh start quad
QUAD_RUNS=${QUAD_RUNS:-q_2p2_keep_budget q_1p3 q_shared4_mor1 q_3p1 q_eager_2p2}
placement_of() {  # placement_of NAME: the overrides of one 4-GPU placement, into PLACEMENT
  case $1 in
    q_2p2) PLACEMENT=(rollout.num_replicas=2 cluster.num_workers=2) ;;
    q_3p1) PLACEMENT=(rollout.num_replicas=3 cluster.num_workers=1) ;;
    q_1p3) PLACEMENT=(train.groups_per_step=3 rollout.num_replicas=1 cluster.num_workers=3) ;;
    q_shared4_mor1) PLACEMENT=(rollout.num_replicas=4 rollout.replica_num_gpus=0.6 cluster.num_workers=4
                               cluster.worker_num_gpus=0.4 rollout.max_ongoing_requests=1) ;;
    # eager: the config's merged replicas need the trainer's old log-probs (train.old_logprob=rollout is refused)
    q_eager_2p2) PLACEMENT=(rollout.num_replicas=2 cluster.num_workers=2 model.compile.enabled=false) ;;
    # issue 36 point 2 in the job: 2 + 2 with each block's gathered base kept from its forward to its backward
    # (74.5 against 40 GiB a rank: H200s only), 1.05x q_2p2 on 2026-11-27
    q_2p2_keep) PLACEMENT=(rollout.num_replicas=2 cluster.num_workers=2 train.reshard_after_forward=false) ;;
    # and activation memory in place of checkpointing (+13 GiB a rank: 1.07x on the 2-GPU split)
    q_2p2_keep_budget) PLACEMENT=(rollout.num_replicas=2 cluster.num_workers=2 train.reshard_after_forward=false
                                  "${BUDGET[@]}") ;;
    # issue 54 point 4: the best placement with the ODE steps outside the SDE window in FP8 (point 3)
    q_2p2_keep_budget_fp8) PLACEMENT=(rollout.num_replicas=2 cluster.num_workers=2 train.reshard_after_forward=false
                                      "${BUDGET[@]}" "${FP8[@]}") ;;
    *) echo "unknown 4-GPU run $1"; return 1 ;;
  esac
}
quad_run() {  # quad_run NAME: one 4-GPU placement, 10 steps
  placement_of $1 || return 1
  JOB_TIMEOUT=480 bash $RUNS job $1 10 "${QUAD[@]}" "${PLACEMENT[@]}" cluster.serve_port=$PORT
}
quad() {  # issue 38: on all four GPUs, one after another, once both lanes are done
  until [ -f $RES/a.done -a -f $RES/b.done ]; do sleep 2; done
  lane 0,1,2,3 q 8003
  for n in 2 4; do  # the LoRA's way out of 2 and 4 ranks: pinned against pageable host memory (BENCH_EXPORT=0: not again)
    [ -n "${CHECK:-}" ] || [ "${BENCH_EXPORT:-1}" = 0 ] && break
    timeout 300 torchrun --standalone --nproc_per_node=$n -m jobs.bench_export --repeats 5 2>&1 | grep '^{' \
      >> $OUT/bench_export.jsonl
  done
  for run in $QUAD_RUNS; do quad_run $run; done
}
LEARN_ON=${LEARN_ON:-q_2p2_keep_budget}  # the best 4-GPU placement measured (lease5_4xh200/)
AFTER_LEARN=${AFTER_LEARN:-q_eager_2p2 q_3p1}  # 4-GPU runs after the learning runs, while the lease lasts
learn4() {  # the learning check and the kill on the best 4-GPU placement: the trained run's trainer worker is
  # SIGKILLed after step 22 and restarts from the checkpoint of step 20 (issue 38 points 3 and 4 in one run); then
  # the same run at lr 0 (same seeds), then the placements a lease before did not reach
  lane 0,1,2,3 q 8003
  placement_of $LEARN_ON || return 1
  KILL_AT=22 JOB_TIMEOUT=1080 bash $RUNS kill q_learn_lr3e-4 40 "${QUAD[@]}" "${LEARN[@]}" train.learning_rate=3e-4 \
    train.checkpoint_every=5 "${PLACEMENT[@]}" cluster.serve_port=$PORT
  JOB_TIMEOUT=900 bash $RUNS job q_learn_lr0 40 "${QUAD[@]}" "${LEARN[@]}" train.learning_rate=0 \
    "${PLACEMENT[@]}" cluster.serve_port=$PORT
  for run in $AFTER_LEARN; do quad_run $run; done
}
pack() {  # logs, metrics, eval results and curves; no checkpoints, images or tensorboard
  (cd /tmp && tar czf $OUT/lanes.tgz --exclude=checkpoints --exclude=images --exclude=tensorboard \
    --exclude='*.npz' --exclude=compile_cache --exclude='*.pt' --exclude='*.safetensors' --exclude='*.png' lanes runs 2>/dev/null)
  # the cache in parts under the 16 MiB a returned file may have: cat compile_cache_scale.tgz.part* > .devcache/...
  [ -d /tmp/compile_cache ] && tar czf - -C /tmp compile_cache | split -b 15m - $OUT/compile_cache_scale.tgz.part \
    && echo "compile cache: $(du -sh /tmp/compile_cache | cut -f1), $(du -ch $OUT/compile_cache_scale.tgz.part* | tail -1 | cut -f1) packed"
  for f in $RES/*/*.log; do echo "== $f"; grep "\[flowgrpo\] step\|exit\|rror" $f | tail -n 3; done
  nvidia-smi --query-gpu=index,memory.used,utilization.gpu --format=csv,noheader
}
case "$1" in
  start) mkdir -p $RES
         [ -f $SEED ] && tar xzf $SEED -C /tmp && echo "compile cache seeded from $SEED"
         bash $RUNS build
         if [ "${2:-quad}" = pair2 ]; then setsid bash $0 pair2 > $RES/pair2.out 2>&1 < /dev/null & sleep 2; echo started
           exit 0; fi
         if [ "${2:-quad}" = quad ] && [ "${LANES:-1}" = 1 ]; then  # LANES=0: straight to the 4-GPU runs
           setsid bash $0 lane_a > $RES/lane_a.out 2>&1 < /dev/null &
           setsid bash $0 lane_b > $RES/lane_b.out 2>&1 < /dev/null &
         else touch $RES/a.done $RES/b.done; fi
         setsid bash $0 ${2:-quad} > $RES/quad.out 2>&1 < /dev/null &
         sleep 2; echo started ;;
  lane_a) lane_a; touch $RES/a.done ;;
  lane_b) lane_b; touch $RES/b.done ;;
  quad) quad; touch $RES/q.done ;;
  learn4) learn4; touch $RES/q.done ;;
  pair2) pair2; touch $RES/p.done ;;
  wait) end=$((SECONDS + $2)); until [ -f $RES/${3:-q}.done ] || [ $SECONDS -ge $end ]; do sleep 5; done
        pack ;;
  collect) pack ;;
esac
