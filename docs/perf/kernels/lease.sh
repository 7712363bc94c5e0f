#!/bin/bash
# A lease of issue 36's stages without gaps: `start STAGE...` runs gpu_runs.sh's stages one after another in the
# background (setsid: they outlive the device tool's call, not the machine), `wait S` sleeps up to S seconds (or until
# every stage is done) and packs what is done into $OUT. One call's 10 minutes no longer bound a stage, and no device
# time idles between calls. A stage with an argument is written STAGE:ARG (rollout_mode:reduce-overhead); VAR=value
# words set a variable for the stages after them (MERGE_ON=device, RUNS=docs/perf/sd3/gpu_runs.sh).
# On a machine of several GPUs, `@GPUS` words split the list into lanes: each lane runs on its GPUs
# (CUDA_VISIBLE_DEVICES) beside the others, and a lane waits for the lanes before it that share a GPU:
#   lease.sh start @0 setup train_step:after @1 RUNS=docs/perf/sd3/gpu_runs.sh build train_step @0,1 train_step_2rank
# A lane on some GPUs runs on its share of the host's cores (taskset; OMP_NUM_THREADS and inductor's compile
# threads to match): beside another lane's compilation a bench otherwise finds its GPU idle for want of a CPU.
# The machine still goes back after 30 minutes held: plan a lease's stages under that. In the project root with the
# device wheels installed and PYTHONPATH set:
#   bash docs/perf/kernels/lease.sh start setup "train_step:after" "BUDGET=0.25" "train_step:budget" ... | wait 560
# $OUT gets kernels.tgz (every lane's files and log, runs/: every job's metrics.jsonl so far, the cache left out)
# and, once every lane is done, the cache in 15 MB parts (compile_cache_kernels.tgz.part*: `cat` them into
# .devcache/compile_cache_kernels.tgz to seed a later lease; PACK_CACHE=0 leaves it on the machine).
set -uo pipefail
RES=${RES:-/tmp/kernels}; RUNS=${RUNS:-docs/perf/kernels/gpu_runs.sh}  # RUNS=stub: a dry run
source "${BASH_SOURCE%/*}/../cores.sh"

run_stages() {  # run_stages OUTDIR STAGE...
  local out=$1; shift
  for stage in "$@"; do
    if [[ $stage == *=* ]]; then export "${stage?}"; echo "== $stage"; continue; fi
    echo "== $stage $(date +%T)"
    OUT=$out bash $RUNS ${stage%%:*} $([[ $stage == *:* ]] && echo "${stage#*:}") 2>&1
    echo "== $stage done $(date +%T)"
  done
}
all_done() { [ -f $RES/lanes ] && [ "$(ls $RES/lane*/done 2>/dev/null | wc -l)" -ge "$(cat $RES/lanes)" ]; }
start_lane() {  # start_lane N GPUS DEPS STAGE...: lane N on GPUS (empty: every GPU) after the lanes DEPS are done
  local n=$1 gpus=$2 deps=$3; shift 3
  local dir=$RES/lane$n pin=() env=""; mkdir -p $dir/out
  if [ -n "$gpus" ]; then
    local cores; cores=$(gpu_cores $gpus); pin=(taskset -c $cores)
    local count; count=$(taskset -c $cores nproc)
    env="export CUDA_VISIBLE_DEVICES=$gpus OMP_NUM_THREADS=$count TORCHINDUCTOR_COMPILE_THREADS=$count;"
  fi
  setsid "${pin[@]}" bash -c "$(declare -f run_stages); RUNS=$RUNS
    for d in $deps; do until [ -f $RES/lane\$d/done ]; do sleep 5; done; done
    $env echo \"== lane $n gpus ${gpus:-all} cores ${cores:-all} \$(date +%T)\"
    run_stages $dir/out $(printf '%q ' "$@"); touch $dir/done" > $dir/stages.log 2>&1 < /dev/null &
}
pack() {
  # the metrics of every job so far, a running one's too: a job the lease's end cuts still brings its steps home
  for m in /tmp/runs/*/metrics.jsonl; do
    [ -f "$m" ] && mkdir -p $RES/runs && cp "$m" "$RES/runs/$(basename "$(dirname "$m")")_metrics.jsonl"
  done
  tar czf $OUT/.kernels.tgz --exclude='*.tgz*' -C $RES . 2>/dev/null; mv $OUT/.kernels.tgz $OUT/kernels.tgz  # whole or none
  if all_done && [ "${PACK_CACHE:-1}" = 1 ] && [ -d /tmp/compile_cache ]; then
    tar czf - -C /tmp compile_cache | split -b 15m - $OUT/compile_cache_kernels.tgz.part
  fi
  ls -la $OUT; for log in $RES/lane*/stages.log; do grep "^== " $log | tail -n 3; done
  nvidia-smi --query-gpu=index,memory.used,utilization.gpu --format=csv,noheader
}
case "$1" in
  start) rm -rf $RES; mkdir -p $RES; shift
         # lanes: the words up to each @GPUS; a list without one is one lane on every GPU
         n=0; gpus=("" ""); words=("" ""); [[ ${1:-} == @* ]] || n=1
         for w in "$@"; do
           if [[ $w == @* ]]; then n=$((n + 1)); gpus[$n]=${w#@}; words[$n]=""; else words[$n]+="$(printf '%q ' "$w")"; fi
         done
         echo $n > $RES/lanes
         for ((i = 1; i <= n; i++)); do
           deps=""
           for ((j = 1; j < i; j++)); do  # an earlier lane on a GPU of this one, or either on every GPU
             if [ -z "${gpus[$i]}" ] || [ -z "${gpus[$j]}" ] \
               || [ -n "$(comm -12 <(tr , '\n' <<< "${gpus[$i]}" | sort) <(tr , '\n' <<< "${gpus[$j]}" | sort))" ]; then
               deps+="$j "
             fi
           done
           eval "start_lane $i '${gpus[$i]}' '$deps' ${words[$i]}"
           echo "lane $i: gpus ${gpus[$i]:-all}, after lanes: ${deps:-none}; ${words[$i]}"
         done ;;
  wait)  # a machine without lanes is a fresh one (the last went back): say so now rather than idle its time away
    [ -f $RES/lanes ] || { echo "lease.sh wait: no stages on this machine (a fresh one: start them again)"; exit 3; }
    # every minute a pack of what is done: a call cut short by the session's device time still brings that home
    end=$((SECONDS + $2)); next=$((SECONDS + 60))
    until all_done || [ $SECONDS -ge $end ]; do
      sleep 5; [ $SECONDS -ge $next ] && { PACK_CACHE=0 pack > /dev/null 2>&1; next=$((SECONDS + 60)); }
    done
    pack ;;
esac
