# Sourced by the lease scripts (kernels/lease.sh, scale/gpu_lanes.sh): a lane of a lease runs on its GPUs' share of
# the host's cores, so that one lane's compilation leaves another lane's benches their CPUs.
gpu_cores() {  # gpu_cores GPUS: the cores of those GPUs' equal shares of the host, as taskset reads them ("0-15,16-31")
  # (NGPUS: the machine's GPUs, for a dry run where nvidia-smi is absent)
  local ngpus=${NGPUS:-$(nvidia-smi -L 2>/dev/null | wc -l)} list=""
  local per=$(($(nproc --all) / (ngpus > 0 ? ngpus : 1)))
  for g in ${1//,/ }; do list+="$((g * per))-$(((g + 1) * per - 1)),"; done
  echo "${list%,}"
}
