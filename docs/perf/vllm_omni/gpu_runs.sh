#!/bin/bash
# Issue 51 on a lent GPU: vllm-omni's engine tests on CUDA, then each family's rollout at its real size (random
# weights), vllm-omni beside the family's in-process engine, eager and each at its best, an adapter served. Stages run
# through docs/perf/kernels/lease.sh (RUNS=docs/perf/vllm_omni/gpu_runs.sh), after the pinned stack was carried and
# installed (docs/perf/vllm_omni/README.md, "A lease"):
#   bash docs/perf/vllm_omni/gpu_runs.sh setup | tests | sdpacheck | sd3diag | model FAMILY | bench FAMILY,ENGINE,MODE | loop MODE
#                                        | trainstep FAMILY | job FAMILY,NAME,STEPS | joinjobs | odesteps FAMILY
#                                        | serving FAMILY | fp8linear [FAMILY]
# FAMILY: qwen_image | sd3 | bagel | flux | z_image | wan (videos: a group of 8 at 480p, 33 frames); ENGINE: vllm_omni | local (diffusers; BAGEL's own model); MODE: eager | best
# (vllm-omni: its regional torch.compile, the adapter in vLLM's LoRA layers; ours: compiled blocks, the adapter
# folded in where the config folds it) | merged (vllm-omni compiled with the adapter folded in: rollout.merge_lora)
# | thinker (BAGEL on vllm-omni's two-stage deploy, eager: rollout.thinker_stage).
# loop MODE: trained steps of the tiny BAGEL (fp32, with the real autoencoder) on one GPU, a vllm-omni replica and one FSDP2 rank sharing it,
# MODE thinker (the two-stage deploy) | single (the DiT builds the contexts), text-to-image prompts (a thinker takes
# no edits), the trainer's old log-probs: `rollout/logprob_mismatch_max` states vllm-omni's against the trainer's.
# vllm-omni's benches also score their first group with the trainer's code once the engine closed (--mismatch).
# trainstep FAMILY: jobs.bench_train_step on one GPU, compiled (the family's recipe). job FAMILY,NAME,STEPS: jobs.train
# on a machine of two GPUs or more with the family's 2-GPU recipe (one replica, one rank), the JPEG reward, compiled,
# JOBARGS (a stage word "JOBARGS=...") added: e.g. rollout.engine=diffusers for the side-by-side run.
# MODELS=/dir keeps one real-size checkpoint at a time (the machine's disk holds 64 GiB).
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
MODELS=${MODELS:-/tmp/models}
CACHE=/tmp/compile_cache
read -r -a EXTRA <<< "${EXTRA:-}"  # more overrides (a dry run on the CPU: a tiny checkpoint at a tiny size)
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1

# per family: run config, preset, bench size (groups per timed pass), the in-process engine's name
declare -A CFG=([qwen_image]=configs/qwen_image_ocr_2gpu.yaml [sd3]=configs/sd35m_ocr.yaml [bagel]=configs/bagel_ocr.yaml
                [flux]=configs/flux_ocr_2gpu.yaml [z_image]=configs/z_image_turbo_ocr_2gpu.yaml
                [wan]=configs/wan_t2v_2gpu.yaml)
declare -A PRESET=([qwen_image]="qwen-image-full" [sd3]="sd35-medium" [bagel]="bagel-real-width --layers 28"
                   [flux]="flux1-dev" [z_image]="z-image" [wan]="wan2.1-t2v-1.3b")
declare -A NGROUPS=([qwen_image]=2 [sd3]=1 [bagel]=2 [flux]=1 [z_image]=2 [wan]=1)
declare -A LOCAL=([qwen_image]=diffusers [sd3]=diffusers [bagel]=bagel [flux]=diffusers [z_image]=diffusers
                  [wan]=diffusers)
# what the config leaves to the user
declare -A SET=([qwen_image]="" [sd3]="data.prompts=ocr_tiny" [bagel]="" [flux]="data.prompts=ocr_tiny"
                [z_image]="data.prompts=ocr_tiny" [wan]="data.prompts=ocr_tiny")
read -r -a JOBARGS <<< "${JOBARGS:-}"

case "$1" in
  setup)  # what the machine is and what runs on it
    { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
      python -c "import torch, vllm, vllm_omni, diffusers; print('torch', torch.__version__, 'cuda', torch.version.cuda,
'cudnn', torch.backends.cudnn.version(), 'nccl', torch.cuda.nccl.version()); print('vllm', vllm.__version__,
'vllm_omni', vllm_omni.__version__, 'diffusers', diffusers.__version__)"; df -h /tmp | tail -1; } 2>&1 | tee "$OUT/device.txt"
    rm -rf /tmp/w ;;  # the carried wheels, installed: their disk back
  tests)  # every family's engine tests on vllm-omni's CUDA platform (`-m gpu` selects them on a GPU machine)
    # TEST_FILES narrows the run (a lease that already has the others' summary lines)
    files=${TEST_FILES:-tests/rollout/test_vllm_omni_engine.py tests/rollout/test_sd3_engines.py
      tests/rollout/test_vllm_omni_bagel.py tests/rollout/test_bagel_thinker.py tests/rollout/test_z_image_engines.py
      tests/rollout/test_flux_engines.py tests/rollout/test_wan_engines.py}
    timeout ${TESTS_TIMEOUT:-1500} python -m pytest -p no:cacheprovider -m gpu -rA --tb=short --durations=0 \
      $files > "$OUT/gpu_tests.txt" 2>&1
    echo "pytest exit $?"; grep -E "^(PASSED|FAILED|ERROR)|passed|failed" "$OUT/gpu_tests.txt" | tail -n 40 ;;
  sdpacheck)  # cuDNN's attention backward against flash's, the gradient contiguous and in diffusers' layout
    python docs/perf/flux/sdpa_backward_check.py 2>&1 | tail -n 12 | tee "$OUT/sdpa_backward.txt" ;;
  sd3diag)  # the building blocks where vllm-omni's SD3 and diffusers' differ, fp32 on the GPU
    python docs/perf/vllm_omni/sd3_kernels.py 2>&1 | tail -n 40 | tee "$OUT/sd3_kernels.txt" ;;
  model)  # model FAMILY: its real-size random checkpoint (the one before it removed)
    family=$2
    for d in "$MODELS"/*; do [ "$d" = "$MODELS/$family" ] || rm -rf "$d"; done
    mkdir -p "$MODELS"
    [ -f "$MODELS/$family/.built" ] || { python -m jobs.make_tiny_models --preset ${PRESET[$family]} \
      --out "$MODELS/$family" 2>&1 | tail -1 && touch "$MODELS/$family/.built"; }
    du -sh "$MODELS/$family"; df -h /tmp | tail -1 ;;
  bench)  # bench FAMILY,ENGINE,MODE: one line of jobs.bench_rollout
    IFS=, read -r family engine mode <<< "$2"
    name=${family}_${engine}_${mode}
    [ $engine = local ] && engine=${LOCAL[$family]}
    merge=false; [ $mode = merged ] && merge=true
    args=(--adapter); [ $engine = vllm_omni ] && args+=(--mismatch rollout.merge_lora=$merge)
    [ $mode = thinker ] && args+=(rollout.thinker_stage=true)  # BAGEL's two-stage deploy, eager
    compiled=false; [ $mode != eager ] && [ $mode != thinker ] && compiled=true
    timeout ${BENCH_TIMEOUT:-560} python -m jobs.bench_rollout --config ${CFG[$family]} --groups ${NGROUPS[$family]} \
      --repeats 2 --batched-only "${args[@]}" model.path="$MODELS/$family" rollout.engine=$engine \
      model.compile.enabled=$compiled model.compile.cache_dir=$CACHE ${SET[$family]} "${EXTRA[@]}" 2>"$OUT/$name.err" | tail -1 \
      | sed "s/^{/{\"run\": \"$name\", /" | tee -a "$OUT/bench_rollout.jsonl"
    tail -n 3 "$OUT/$name.err" ;;
  loop)
    name=bagel_loop_$2; thinker=false; [ $2 = thinker ] && thinker=true
    tiny=/tmp/tiny-bagel-full-ae  # the real autoencoder: the thinker's own model builds it whatever the checkpoint says
    python -m jobs.make_tiny_models --preset tiny-bagel-full-ae --out $tiny 2>&1 | tail -n 1
    timeout ${LOOP_TIMEOUT:-420} python -m jobs.train --config configs/tiny_bagel_cpu.yaml rollout.engine=vllm_omni \
      model.path=$tiny model.build_tiny=false \
      rollout.thinker_stage=$thinker rollout.num_replicas=1 rollout.replica_num_gpus=0.5 cluster.num_workers=1 \
      cluster.use_gpu=true cluster.worker_num_gpus=0.5 data.prompts=ocr_tiny eval.before_train=false eval.every=0 \
      train.num_steps=${LOOP_STEPS:-3} train.groups_per_step=2 train.checkpoint_every=0 train.old_logprob=trainer \
      logging.image_every=0 logging.dir=/tmp/runs/$name > "$OUT/$name.log" 2>&1
    echo "$name: exit $?"; cp /tmp/runs/$name/metrics.jsonl "$OUT/${name}_metrics.jsonl" 2>/dev/null
    grep -E "\[flowgrpo\] step|Error|error" "$OUT/$name.log" | tail -n 8 ;;
  trainstep)  # trainstep FAMILY: the trainer's update at real size, compiled, one GPU; RETRY_NOCUDNN=1: a bench that
    # fails runs once more without cuDNN's attention (the eighth session's FLUX failure: docs/gpus.md), named
    # ..._nocudnn. A trainer leaves cuDNN out by default since 215f4b1, so a failure (out of memory) is not retried.
    # PROFILE=1: one more micro-batch under the torch profiler, its GPU time by kind of kernel in NAME_HHMMSS_profile.json
    family=$2
    retries=(""); [ "${RETRY_NOCUDNN:-0}" = 1 ] && retries+=("model.attention_kernels=[flash,efficient,math]")
    for kernels in "${retries[@]}"; do
      name=${family}_trainstep${kernels:+_nocudnn}
      prof=(); [ "${PROFILE:-0}" = 1 ] && prof=(--profile "$OUT/${name}_$(date +%H%M%S)_profile.json")
      line=$(timeout ${BENCH_TIMEOUT:-560} python -m jobs.bench_train_step --config ${CFG[$family]} --groups 2 --repeats 3 \
        "${prof[@]}" model.path="$MODELS/$family" model.compile.cache_dir=$CACHE ${SET[$family]} "${EXTRA[@]}" $kernels \
        2>>"$OUT/$name.err" | tail -1)
      tail -n 3 "$OUT/$name.err"
      [[ $line == "{"* ]] && { sed "s/^{/{\"run\": \"$name\", /" <<< "$line" | tee -a "$OUT/bench_train_step.jsonl"; break; }
    done ;;
  odesteps)  # odesteps FAMILY: cheaper ODE steps (rollout.ode_steps) against the full computation, the diffusers
    # engine compiled, the run's groups and seeds (issue 54: speed-up, reward shift beside the seed-to-seed spread):
    # First Block Cache at THRESHOLDS (THRESHOLDS= for none) and FP8 matmuls; the JPEG reward, as the jobs (random
    # weights score 0 in OCR); EXTRA after the stage's SDE window (2 of steps 0-5) replaces it
    family=$2
    read -r -a thresholds <<< "${THRESHOLDS-0.05 0.1}"
    timeout ${BENCH_TIMEOUT:-560} python -m jobs.bench_ode_steps --config ${CFG[$family]} --groups ${ODE_GROUPS:-8} \
      model.path="$MODELS/$family" rollout.engine=${LOCAL[$family]} model.compile.cache_dir=$CACHE ${SET[$family]} \
      "reward.weights={jpeg_compressibility: 1.0}" rollout.sde_window.size=2 "rollout.sde_window.range=[0,5]" \
      "${EXTRA[@]}" --thresholds "${thresholds[@]}" --fp8 2>"$OUT/${family}_ode_steps.err" | tail -1 \
      | sed "s/^{/{\"run\": \"${family}_ode_steps\", /" | tee -a "$OUT/bench_ode_steps.jsonl"
    tail -n 3 "$OUT/${family}_ode_steps.err" ;;
  serving)  # serving FAMILY: jobs.bench_serving, a vllm-omni replica of the family on the GPU, eager: HTTP beside the
    # Serve handle at CLIENTS concurrent clients (default 1 4 16 64; issue 56)
    family=$2
    timeout ${BENCH_TIMEOUT:-560} python -m jobs.bench_serving --config ${CFG[$family]} --out "$OUT/bench_serving.jsonl" \
      model.path="$MODELS/$family" rollout.engine=vllm_omni model.compile.enabled=false ${SET[$family]} "${EXTRA[@]}" \
      --concurrency ${CLIENTS:-1 4 16 64} 2>"$OUT/${family}_serving.err" | tail -n 12
    tail -n 3 "$OUT/${family}_serving.err" ;;
  job)  # job FAMILY,NAME,STEPS: the family's 2-GPU recipe in jobs.train, JPEG reward, pipelined; RETRY_NOCUDNN=1:
    # a failed job runs once more without cuDNN's attention, named NAME_nocudnn. BESIDE=1: the job starts in the
    # background, beside the other jobs started so (each its own local Ray cluster and Serve port; `joinjobs`
    # waits for them), where every GPU holds BESIDE_MIN_MIB (default 100000: an H200, not an H100, fits two
    # real-size jobs); elsewhere it runs now. Their start-ups overlap the other's steps: a learning check's jobs
    # (issue 54) in less device time; their timings are then not one job's
    IFS=, read -r family base steps <<< "$2"
    if [ "${BESIDE:-0}" = 1 ]; then
      least=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | sort -n | head -1)
      if [ "${least:-0}" -ge "${BESIDE_MIN_MIB:-100000}" ]; then
        mkdir -p /tmp/jobs_beside; port=$((8001 + $(ls /tmp/jobs_beside | wc -l)))
        # (the overrides as words again: bash passes no array to a child)
        env BESIDE=0 SERVE_PORT=$port EXTRA="${EXTRA[*]}" JOBARGS="${JOBARGS[*]}" bash "$0" job "$2" \
          > "$OUT/${base}_stage.txt" 2>&1 < /dev/null &
        echo $! > /tmp/jobs_beside/$base.pid; echo "$base: started beside the others (Serve port $port)"; exit 0
      fi
      echo "$base: runs alone (a GPU of ${least:-no} MiB: under BESIDE_MIN_MIB)"
    fi
    for kernels in "" "model.attention_kernels=[flash,efficient,math]"; do
      name=$base${kernels:+_nocudnn}
      timeout ${JOB_TIMEOUT:-560} python -m jobs.train --config ${CFG[$family]} model.path="$MODELS/$family" \
        model.compile.cache_dir=$CACHE ${SET[$family]} "reward.weights={jpeg_compressibility: 1.0}" train.num_steps=$steps \
        cluster.serve_port=${SERVE_PORT:-8000} train.checkpoint_every=0 eval.every=0 eval.before_train=false \
        logging.image_every=0 logging.dir=/tmp/runs/$name \
        "${JOBARGS[@]}" "${EXTRA[@]}" $kernels > "$OUT/$name.log" 2>&1
      code=$?; echo "$name: exit $code"; cp /tmp/runs/$name/metrics.jsonl "$OUT/${name}_metrics.jsonl" 2>/dev/null
      grep -E "\[flowgrpo\] step|Error" "$OUT/$name.log" | tail -n 12
      [ $code = 0 ] || [ "${RETRY_NOCUDNN:-0}" != 1 ] && break
    done ;;
  joinjobs)  # wait for the jobs started beside the others (job with BESIDE=1), then show each one's stage output
    for pid in /tmp/jobs_beside/*.pid; do
      [ -e "$pid" ] || continue
      while kill -0 "$(cat "$pid")" 2>/dev/null; do sleep 5; done
      cat "$OUT/$(basename "$pid" .pid)_stage.txt"; rm -f "$pid"
    done ;;
  fp8linear)  # [FAMILY] one linear layer at the blocks' shapes, bf16 against FP8's ways (docs/perf/ode_steps/fp8_linear_bench.py)
    timeout ${BENCH_TIMEOUT:-300} python docs/perf/ode_steps/fp8_linear_bench.py ${2:+--family $2} > "$OUT/fp8_linear.jsonl" \
      2> "$OUT/fp8_linear.err"; echo "fp8linear: exit $?"; cut -c1-400 "$OUT/fp8_linear.jsonl" ;;
  *) echo "unknown stage $1" >&2; exit 2 ;;
esac
