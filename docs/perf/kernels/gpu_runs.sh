#!/bin/bash
# Issue 36's levers side by side on one lent GPU: the Qwen-Image trainer and rollout benches before and after, one
# device call per stage, back to back (the machine keeps /tmp only while calls follow each other). In the project
# root with the device wheels installed and PYTHONPATH set:
#   bash docs/perf/kernels/gpu_runs.sh setup | train_step VARIANT | train_step_2rank | rollout | rollout_merged |
#     rollout_mode MODE | attention KERNEL | cache | bagel | pack
# VARIANT: before (FSDP2 copies the frozen base, diffusers' complex RoPE: the code of 2026-11-25), after (today's
# defaults), budget (after, with compile's activation memory budget instead of whole-block recomputation).
# The GPU image has no vllm: the rollout bench runs the diffusers engine.
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
MODEL=${MODEL:-/tmp/qwen-image-full}
CACHE=/tmp/compile_cache
CFG=${CFG:-configs/qwen_image_ocr_2gpu.yaml}  # MODEL=, CFG=: a dry run on the CPU with a tiny model
BEFORE=(--shard-frozen model.compile.real_rope=false)
BUDGET=(train.gradient_checkpointing=false train.activation_memory_budget=${BUDGET:-0.5})
BAGEL=${BAGEL:-/tmp/bagel-real-width}  # BAGEL=, BAGEL_CFG=: the bagel stage's dry run on the CPU
BAGEL_CFG=${BAGEL_CFG:-configs/bagel_ocr.yaml}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1

case "$1" in
  setup)  # the real-size random Qwen-Image (60 blocks, 20.4B, bf16); the benches' cache seeded from an earlier
    # lease's (`pack`), when carried (`carry: [".devcache"]`)
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/device.txt"
    seed=${SEED_CACHE:-.devcache/compile_cache_kernels.tgz}
    [ -f $seed ] && tar xzf $seed -C /tmp && echo "compile cache seeded from $seed"
    python -m jobs.make_tiny_models --preset qwen-image-full --out $MODEL 2>&1 | tail -1 ;;
  train_step)  # 2 groups of 8 at 512², CFG 4, 2 of 10 steps trained (the config's recipe), compiled
    extra=(); [ $2 = before ] && extra=("${BEFORE[@]}"); [ $2 = budget ] && extra=("${BUDGET[@]}")
    timeout ${BENCH_TIMEOUT:-560} python -m jobs.bench_train_step --config $CFG --groups 2 --repeats 3 \
      --profile "$OUT/profile_train_$2.json" model.path=$MODEL model.compile.cache_dir=$CACHE "${extra[@]}" \
      2>"$OUT/train_step_$2.err" | tail -1 | sed "s/^{/{\"variant\": \"$2\", /" | tee -a "$OUT/bench_train_step.jsonl"
    tail -n 3 "$OUT/train_step_$2.err" ;;
  train_step_2rank)  # two FSDP2 ranks (a 2-GPU machine), the base sharded: FSDP2 frees each block's gathered
    # weights after its forward (true) or keeps them for the backward (false), 2 groups on each rank
    for reshard in true false; do
      timeout ${BENCH_TIMEOUT:-560} torchrun --standalone --nproc_per_node=2 -m jobs.bench_train_step --config $CFG \
        --groups 2 --repeats 3 model.path=$MODEL model.compile.cache_dir=$CACHE train.reshard_after_forward=$reshard \
        2>"$OUT/train_step_2rank_$reshard.err" | tail -1 | sed "s/^{/{\"variant\": \"reshard_$reshard\", /" \
        | tee -a "$OUT/bench_train_step_2rank.jsonl"
      tail -n 3 "$OUT/train_step_2rank_$reshard.err"
    done ;;
  attention)  # attention KERNEL: the attention kernel forced (model.attention_kernels; default: torch's choice),
    # the trainer bench then the rollout bench; one kernel per call
    # (math beside it: the fallback for the VAE's attention, which no fast kernel takes)
    extra=(); [ $2 != default ] && extra=("model.attention_kernels=[$2,math]")
    timeout ${BENCH_TIMEOUT:-330} python -m jobs.bench_train_step --config $CFG --groups 2 --repeats 2 \
      model.path=$MODEL model.compile.cache_dir=$CACHE "${extra[@]}" 2>"$OUT/attention_train_$2.err" \
      | tail -1 | sed "s/^{/{\"variant\": \"$2\", /" | tee -a "$OUT/bench_attention.jsonl"
    timeout ${BENCH_TIMEOUT2:-230} python -m jobs.bench_rollout --config $CFG --groups 2 --repeats 2 --batched-only \
      model.path=$MODEL model.compile.cache_dir=$CACHE "${extra[@]}" 2>"$OUT/attention_rollout_$2.err" \
      | tail -1 | sed "s/^{/{\"variant\": \"$2\", /" | tee -a "$OUT/bench_attention.jsonl" ;;
  cache)  # the first compiled pass cold, then in a new process given a copy of that cache at another path (what a
    # fresh machine sees when the folder is carried to it); the folder comes back for a later lease's check
    rm -rf /tmp/ccA /tmp/ccB /tmp/torchinductor_* ~/.triton ~/.cache/triton
    for run in cold warm_copied; do
      dir=/tmp/ccA; [ $run = warm_copied ] && { cp -r /tmp/ccA /tmp/ccB; rm -rf /tmp/torchinductor_* ~/.triton; dir=/tmp/ccB; }
      timeout ${BENCH_TIMEOUT:-400} python -m jobs.bench_train_step --config $CFG --groups 2 --repeats 2 \
        model.path=$MODEL model.compile.cache_dir=$dir 2>"$OUT/cache_$run.err" | tail -1 \
        | sed "s/^{/{\"variant\": \"$run\", /" | tee -a "$OUT/bench_cache.jsonl"
      tail -n 2 "$OUT/cache_$run.err"
    done
    du -sh /tmp/ccA; tar czf - -C /tmp ccA | split -b 15m - "$OUT/compile_cache_qwen_image_train.tgz.part"; ls -la "$OUT"/*.part* ;;
  rollout)  # a group of 8 at 512², CFG 4, 10 steps, compiled: complex RoPE, then real
    for rope in false true; do
      timeout ${BENCH_TIMEOUT:-280} python -m jobs.bench_rollout --config $CFG --groups 2 --repeats 3 --batched-only \
        model.path=$MODEL model.compile.cache_dir=$CACHE model.compile.real_rope=$rope 2>"$OUT/rollout_$rope.err" \
        | tail -1 | tee -a "$OUT/bench_rollout.jsonl"
      tail -n 2 "$OUT/rollout_$rope.err"
    done ;;
  rollout_merged)  # a served adapter (r=64, the config's 12 targets) beside the weights (peft) against folded
    # into them (rollout.merge_lora), compiled, then the swap to a second version, then one group profiled (how
    # busy the GPU is: what CUDA graphs could win). The adapted weights' copy: on the
    # host by default (27 GB of them). With the real 7B text encoder only an H200 replica has room for the device
    # copy; the random checkpoint's encoder has 2 layers, so MERGE_ON=device fits an H100 here (about 68 GB)
    for merge in false true; do
      timeout ${BENCH_TIMEOUT:-280} python -m jobs.bench_rollout --config $CFG --groups 2 --repeats 3 --batched-only \
        --adapter --profile "$OUT/profile_rollout_merge_$merge.json" model.path=$MODEL model.compile.cache_dir=$CACHE rollout.merge_lora=$merge \
        rollout.merged_base_on=${MERGE_ON:-host} 2>"$OUT/rollout_merge_$merge.err" \
        | tail -1 | tee -a "$OUT/bench_rollout_merge.jsonl"
      tail -n 2 "$OUT/rollout_merge_$merge.err"
    done ;;
  rollout_mode)  # rollout_mode MODE: torch.compile's mode for the engine's blocks (default, reduce-overhead: CUDA
    # graphs, max-autotune-no-cudagraphs: autotuned kernels), one group profiled; one mode per call (autotuning is long)
    timeout ${BENCH_TIMEOUT:-560} python -m jobs.bench_rollout --config $CFG --groups 2 --repeats 3 --batched-only \
      --profile "$OUT/profile_rollout_$2.json" model.path=$MODEL model.compile.cache_dir=$CACHE \
      model.compile.mode=$2 2>"$OUT/rollout_$2.err" | tail -1 | tee -a "$OUT/bench_rollout_modes.jsonl"
    tail -n 2 "$OUT/rollout_$2.err" ;;
  bagel)  # point 7: BAGEL's two benches, eager then compiled, at BAGEL-7B-MoT's layer width with BAGEL_LAYERS of its
    # 28 layers (default 8: MFU reads the per-layer cost; the whole model beside the Qwen-Image checkpoint would not
    # fit the machine's 64 GiB disk); the recipe of configs/bagel_ocr.yaml (groups of 8 at 512², CFG 4, 2 of 10
    # steps trained, LoRA r=64 on the generation expert)
    [ -f $BAGEL/config.json ] || python -m jobs.make_tiny_models --preset bagel-real-width \
      --layers ${BAGEL_LAYERS:-8} --out $BAGEL 2>&1 | tail -1
    for compiled in false true; do
      timeout ${BENCH_TIMEOUT:-240} python -m jobs.bench_train_step --config $BAGEL_CFG --groups 2 --repeats 3 \
        model.path=$BAGEL model.compile.enabled=$compiled model.compile.cache_dir=$CACHE train.old_logprob=trainer \
        2>"$OUT/bagel_train_$compiled.err" | tail -1 | sed "s/^{/{\"variant\": \"compiled_$compiled\", /" \
        | tee -a "$OUT/bench_bagel.jsonl"
      tail -n 2 "$OUT/bagel_train_$compiled.err"
      timeout ${BENCH_TIMEOUT2:-200} python -m jobs.bench_rollout --config $BAGEL_CFG --groups 2 --repeats 3 \
        --batched-only model.path=$BAGEL model.compile.enabled=$compiled model.compile.cache_dir=$CACHE \
        train.old_logprob=trainer \
        2>"$OUT/bagel_rollout_$compiled.err" | tail -1 | sed "s/^{/{\"variant\": \"compiled_$compiled\", /" \
        | tee -a "$OUT/bench_bagel.jsonl"
      tail -n 2 "$OUT/bagel_rollout_$compiled.err"
    done ;;
  pack)  # the benches' inductor cache, for the next lease, in parts under the 16 MiB a returned file may have
    # (here: `cat compile_cache_kernels.tgz.part* > .devcache/compile_cache_kernels.tgz`)
    tar czf - -C /tmp compile_cache | split -b 15m - "$OUT/compile_cache_kernels.tgz.part" && du -ch "$OUT"/*.part* ;;
esac
