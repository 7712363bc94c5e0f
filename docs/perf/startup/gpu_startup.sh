#!/bin/bash
# jobs.train's start on one lent GPU, SD3.5-Medium at its real size (random weights), one step: the Train workers
# started after the Serve replicas are ready (`jobs/train_serial.py`: the job before the change, `git show fa50871:jobs/train.py >
# jobs/train_serial.py`, not committed) against while they load (`jobs.train`), alternated. Seconds from the command's start to rank 0's step-1
# line and to the end. In the project root, device wheels installed, PYTHONPATH set:
#   bash docs/perf/startup/gpu_startup.sh build | ROUNDS
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
MODEL=/tmp/sd35m
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
ARGS=(model.path=$MODEL data.prompts=ocr_tiny rollout.engine=diffusers model.compile.enabled=false
      train.old_logprob=rollout cluster.address=null rollout.num_replicas=1 rollout.replica_num_gpus=0.5
      rollout.replica_num_cpus=2 cluster.num_workers=1 cluster.worker_num_gpus=0.5 reward.num_replicas=2
      reward.replica_num_cpus=2 train.groups_per_step=2 train.checkpoint_every=0 logging.image_every=0 eval.every=0
      train.num_steps=1)
stamp() { python -c "
import sys, time
t0 = float(sys.argv[1]); first = None
for line in sys.stdin:
    if first is None and '[flowgrpo] step 1/' in line:
        first = time.time() - t0
print(f'{sys.argv[2]} step1_s {first:.1f} total_s {time.time() - t0:.1f}', flush=True)" "$1" "$2"; }
case "$1" in
  build)
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/device.txt"
    python -m jobs.make_tiny_models --preset sd35-medium --out $MODEL 2>&1 | tail -1 ;;
  *)
    for round in $(seq ${FIRST:-1} "$1"); do
      order="jobs.train_serial jobs.train"; [ $((round % 2)) = 0 ] && order="jobs.train jobs.train_serial"
      for module in $order; do  # alternated: the first run of a round reads the checkpoint from disk, not cache
        t0=$(date +%s.%N)
        timeout 280 python -m $module --config configs/sd35m_ocr_fast.yaml "${ARGS[@]}" logging.dir=/tmp/runs/$module$round \
          2>&1 | tee "$OUT/${module}_$round.log" | stamp "$t0" "$module" | tee -a "$OUT/startup.txt"
      done
    done ;;
esac
