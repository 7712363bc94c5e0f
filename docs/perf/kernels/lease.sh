#!/bin/bash
# A one-GPU lease of issue 36's stages without gaps: `start STAGE...` runs gpu_runs.sh's stages one after another in
# the background (setsid: they outlive the device tool's call, not the machine), `wait S` sleeps up to S seconds
# (or until every stage is done) and packs what is done into $OUT. One call's 10 minutes no longer bound a stage,
# and no device time idles between calls. A stage with an argument is written STAGE:ARG (rollout_mode:reduce-overhead);
# VAR=value words set a variable for the stages after them (MERGE_ON=device). The machine still goes back after 30
# minutes held: plan a lease's stages under that. In the project root with the device wheels installed and
# PYTHONPATH set:
#   bash docs/perf/kernels/lease.sh start setup "train_step:after" "BUDGET=0.25" "train_step:budget" ... | wait 560
# $OUT gets kernels.tgz (every stage's files, the cache left out) and, once the stages are done, the cache in 15 MB
# parts (compile_cache_kernels.tgz.part*: `cat` them into .devcache/compile_cache_kernels.tgz to seed a later lease).
set -uo pipefail
RES=/tmp/kernels; RUNS=${RUNS:-docs/perf/kernels/gpu_runs.sh}  # RUNS=stub: a dry run

run_stages() {
  for stage in "$@"; do
    if [[ $stage == *=* ]]; then export "${stage?}"; echo "== $stage"; continue; fi
    echo "== $stage $(date +%T)"
    OUT=$RES/out bash $RUNS ${stage%%:*} $([[ $stage == *:* ]] && echo "${stage#*:}") 2>&1
    echo "== $stage done $(date +%T)"
  done
}
pack() {
  tar czf $OUT/kernels.tgz --exclude='*.tgz*' -C $RES out stages.log 2>/dev/null
  if [ -f $RES/done ] && [ -d /tmp/compile_cache ]; then
    tar czf - -C /tmp compile_cache | split -b 15m - $OUT/compile_cache_kernels.tgz.part
  fi
  ls -la $OUT; grep "^== " $RES/stages.log | tail -n 4; nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader
}
case "$1" in
  start) mkdir -p $RES/out; rm -f $RES/done; shift
         setsid bash -c "$(declare -f run_stages); RES=$RES RUNS=$RUNS; run_stages $(printf '%q ' "$@"); touch $RES/done" \
           > $RES/stages.log 2>&1 < /dev/null &
         sleep 2; echo "started: $*" ;;
  wait) end=$((SECONDS + $2)); until [ -f $RES/done ] || [ $SECONDS -ge $end ]; do sleep 5; done
        pack ;;
esac
