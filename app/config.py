"""The schema of a run: every setting and every default lives here; YAML files only set values.

`load("configs/tiny_cpu.yaml", ["train.learning_rate=3e-4"])` merges the YAML and the `key=value` overrides
onto the dataclasses below through `OmegaConf.structured`, so an unknown key or a value of the wrong type is
an error that names the key. `???` marks a value every run must set. Derived sizes are checked once, in
`RunConfig.__post_init__`, with messages that say what to change; the rules every request obeys (sizes, steps,
guidance) are `GenerationRequest`'s alone, applied to the request the rollout section produces.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from omegaconf import MISSING, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from app.algo.sde import SDE_TYPES
from app.algo.sde_window import PLACEMENTS
from app.models.attention import SDPA_KERNELS
from app.models.compile import CUDA_GRAPH_MODES
from app.models.family import FAMILY_NAMES, all_engines, get_family
from app.rewards.composite import MODEL_REWARDS, REWARD_NAMES, VIDEO_REWARDS
from app.rewards.ocr import DETECT_MIN_SIDE
from app.types import CFG_RENORMS, GenerationRequest, RequestError


def _choices(name: str, values: tuple[str, ...]) -> type[StrEnum]:
    """A StrEnum of `values`, each member named as its value: OmegaConf matches a setting to a member by name."""
    return StrEnum(name, {v: v for v in values}, module=__name__)


# Enumerated choices: OmegaConf refuses any other value and names the key; members compare equal to their strings.
# model families (app/models/family.py's registry) and the rollout engines they run on: declared by the families
ModelFamily = _choices("ModelFamily", FAMILY_NAMES)
ModelFamily.__doc__ = ("A folder of app/models/ (qwen_image: a diffusers Qwen-Image checkpoint; bagel: BAGEL-7B-MoT; "
                       "sd3: a diffusers SD3 checkpoint; flux: a diffusers FLUX.1 checkpoint).")


class DType(StrEnum):
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


# what a rollout replica runs: vllm-omni, or the family's in-process engine (where vllm is not installed)
Engine = _choices("Engine", all_engines())


# The sampling choices are declared once, where they are implemented; the schema's enums are built from them.
# the samplers of app/algo/sde.py
SdeType = _choices("SdeType", SDE_TYPES)
# where a group's SDE window goes (app/algo/sde_window.py): random per group (Flow-GRPO-Fast), fixed at `start`
# for every group, or sliding from `start`, `stride` steps later every `every` training steps (MixGRPO)
WindowPlacement = _choices("WindowPlacement", PLACEMENTS)
# BAGEL's renormalisation of the guided velocity (app/models/bagel.py combine_cfg; GenerationRequest.cfg_renorm)
CfgRenorm = _choices("CfgRenorm", CFG_RENORMS)


class AdvStdMode(StrEnum):
    group = "group"  # GRPO: each prompt group's own std
    batch = "batch"  # FlowGRPO global_std: the std of the whole step's rewards


class OldLogprob(StrEnum):
    rollout = "rollout"  # as the engine recorded them
    recompute = "recompute"  # one extra forward of the current policy
    trainer = "trainer"  # the training forward's own, on the first pass (free; exact under torch.compile)


# where a rollout engine that folds the LoRA into its weights keeps the base weights' copy
MergedBaseOn = _choices("MergedBaseOn", ("device", "host", "auto"))
# torch.compile's modes (None: its default); "reduce-overhead" adds CUDA graphs
CompileMode = _choices("CompileMode", ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"))
CompileGuards = _choices("CompileGuards", ("full", "lean", "skip"))


class LogLevel(StrEnum):
    DEBUG = "DEBUG"
    INFO = "INFO"
    WARNING = "WARNING"
    ERROR = "ERROR"


class ConfigError(ValueError):
    """A run configuration that cannot be used; the message names the key and what to change."""


@dataclass
class CompileConfig:
    # regional torch.compile of the family's repeated blocks (`ModelFamily.compiled_blocks`): in the trainer (each
    # block after FSDP2 wraps it) and in the in-process engines; vllm-omni compiles with its own setting on CUDA
    # (`enforce_eager` follows this; its CPU platform stays eager). A compiled forward with gradients is not
    # bit-equal to one without: with it on, take old log-probs from the trainer (train.old_logprob: trainer)
    enabled: bool = False
    backend: str = "inductor"
    # the CUDA-graph modes (reduce-overhead, max-autotune) replay graphs in the engines' no-grad denoisers, one step
    # of torch's graph trees per forward; the trainer compiles the same mode without CUDA graphs
    mode: CompileMode = CompileMode.default
    # inductor's cache (FX graphs, autograd graphs, kernels), shared by the run's processes so that a restarted
    # worker, a replacement replica and --resume start warm; null: <logging.dir>/compile_cache for jobs.train,
    # torch's own (/tmp/torchinductor_<user>) elsewhere. Put it on shared storage on a multi-node cluster
    cache_dir: str | None = None
    # Qwen-Image and Z-Image: the rotary embedding in real arithmetic in every process that compiles (inductor fuses
    # it; diffusers' complex multiply runs as eager kernels inside the compiled blocks, and Z-Image's autocast region
    # kept its graphs out of AOTAutograd's cache). The same numbers on the CPU to the last bit
    # (app/models/qwen_image/rope.py, app/models/z_image/rope.py); false: diffusers' own
    real_rope: bool = True
    # the trainer's compiled blocks: `full` checks every guard dynamo made at each call of each block; `lean` drops
    # those on module attributes a trainer never changes after its first step (hooks, types, constants), keeping
    # the adapter's switches, tensors, grad mode and shapes (app/models/compile.py `lean_guards`); `skip`: lean for
    # the first step, then only the guards that tell a block's graphs apart (the adapter on or off, grad mode:
    # torch's skip_guard_eval_unsafe), since every later step calls the blocks as the first did. Unsafe where a
    # later step would need a graph the first did not make: the first pass's |ratio - 1| says so. Engines: full
    guards: CompileGuards = CompileGuards.full


@dataclass
class ModelConfig:
    # model family: a folder of app/models/ (its denoiser, conditioning, LoRA targets, checkpoint layout)
    family: ModelFamily = ModelFamily("qwen_image")
    # checkpoint folder: diffusers layout for qwen_image (model_index.json), BAGEL-7B-MoT layout for bagel
    path: str = MISSING
    # build a deterministic tiny random checkpoint at `path` when it is absent (tests, CPU demo); never downloads
    build_tiny: bool = False
    # seed of the tiny checkpoint (only with build_tiny)
    tiny_seed: int = 0
    # compute dtype of the transformer for rollout and training; the SDE math is fp32 regardless
    dtype: DType = DType.bfloat16
    # LoRA of the transformer trained by FlowGRPO; no target modules: the family's (`ModelFamily.lora_targets`)
    lora_rank: int = 32
    lora_alpha: int = 64
    lora_target_modules: list[str] | None = None
    compile: CompileConfig = field(default_factory=CompileConfig)
    # the kernels torch's scaled_dot_product_attention may choose among in the trainer and the in-process engines
    # (cudnn, flash, efficient, math; app/models/attention.py); null: torch's own choice (cuDNN first on Hopper), less
    # cuDNN in a trainer on a GPU (its backward: docs/gpus.md).
    # Strict: a list none of whose kernels takes the inputs (cudnn on a CPU, flash with a mask) fails with torch's
    # "No viable backend" at the first forward; add math as the fallback. vllm-omni's workers pick their own
    attention_kernels: list[str] | None = None

    @property
    def lora_targets(self) -> list[str]:
        """The LoRA's target modules: `lora_target_modules`, or the family's."""
        return list(self.lora_target_modules or get_family(self.family).lora_targets)


@dataclass
class SdeWindowConfig:
    # denoising steps sampled with SDE noise, and the only ones trained; the others take the ODE step (training
    # cost falls by num_inference_steps / size). 0: no window, every step is stochastic
    size: int = 0
    placement: WindowPlacement = WindowPlacement.random
    # random: the steps [lo, hi) the window lies in (flow_grpo's sde_window_range; e.g. [0, 5] of 10 keeps the
    # noise in the first half, where the layout is decided); null: anywhere
    range: list[int] | None = None
    start: int = 0  # fixed: the window's first step; sliding: where it starts
    every: int = 1  # sliding: the window moves every this many training steps ...
    stride: int = 1  # ... by this many denoising steps, and stays at the end

    def window(self, num_steps: int, *, seed: int, group: int, step: int) -> tuple[int, int] | None:
        """Group `group`'s window (first, last + 1) at training step `step`; None without a window."""
        if self.size == 0:
            return None
        from app.algo.sde_window import place_window

        return place_window(num_steps, self.size, str(self.placement), seed=seed, group=group, step=step,
                            start=self.start, every=self.every, stride=self.stride,
                            within=tuple(self.range) if self.range is not None else None)


@dataclass
class OdeStepsConfig:
    # the steps outside the SDE window (noise level 0, never scored by the trainer) computed more cheaply; the window's
    # steps are untouched, so the first pass stays exact (app/rollout/ode_steps.py). "none", or "first_block":
    # diffusers' First Block Cache (an ODE step runs the first block and, when its residual moved less than
    # `threshold` since the last full step, reuses the other blocks' residual). The in-process diffusers engines
    cache: str = "none"
    threshold: float = 0.05
    # "model" (the model's dtype) or "fp8": the blocks' linear layers multiply in float8 e4m3 on those steps (GPUs of
    # compute capability 8.9 or newer: Ada, Hopper, Blackwell; the CPU's FP8 GEMM for the tests). Either or both
    precision: str = "model"
    # FP8's scales (precision fp8 only): "rowwise" (each activation row and weight channel its own, torchao's
    # rowwise) or "tensorwise" (one for each operand); and the GEMM's faster accumulation on Hopper (torchao's
    # forward uses it), less precise
    fp8_scaling: str = "rowwise"
    fp8_fast_accum: bool = False


@dataclass
class RolloutConfig:
    # images per prompt group (the GRPO group size n); one request per group
    group_size: int = 8
    height: int = 512
    width: int = 512
    # frames of each video, a video family only (Wan: 4k + 1, e.g. 33 or 81); null for an image family
    num_frames: int | None = None
    # denoising steps of a rollout (T), as diffusers and vllm-omni name them
    num_inference_steps: int = 10
    # text CFG scale (Qwen-Image `true_cfg_scale`, BAGEL `cfg_text_scale`); 1.0 disables CFG and the negative
    # prompt. BAGEL: "" conditions the unguided branch on the empty context (upstream's default)
    guidance_scale: float = 1.0
    negative_prompt: str = " "
    # a guidance-distilled model's guidance input (FLUX.1-dev: its guidance embedding, 3.5 as flow_grpo trains it):
    # one forward a step; None for the models without one
    embedded_guidance_scale: float | None = None
    # BAGEL only: image CFG of an edit (`cfg_img_scale`), the σ interval (lo, hi] where CFG applies, the
    # renormalisation of the guided velocity and its lower clamp, the schedule's shift
    image_guidance_scale: float = 1.0
    cfg_interval: list[float] = field(default_factory=lambda: [0.0, 1.0])
    cfg_renorm: CfgRenorm = CfgRenorm("global")
    cfg_renorm_min: float = 0.0
    timestep_shift: float = 3.0
    # η: SDE noise level of the sampler; 0 is the deterministic ODE (nothing to train on)
    noise_level: float = 0.7
    # "sde" (FlowGRPO) or "cps" (coefficient-preserving sampling)
    sde_type: SdeType = SdeType.sde
    # SDE noise on a window of the steps only (Flow-GRPO-Fast, MixGRPO); off by default
    sde_window: SdeWindowConfig = field(default_factory=SdeWindowConfig)
    # cheaper ODE steps outside the window (off by default)
    ode_steps: OdeStepsConfig = field(default_factory=OdeStepsConfig)
    # "vllm_omni" (the serving engine) or the family's in-process engine ("diffusers", "bagel": the reference)
    engine: Engine = Engine.vllm_omni
    # True: one request per group with num_outputs_per_prompt = n; False: n requests of one image (comparison)
    batched_groups: bool = True
    # Ray Serve replicas of the rollout engine and the resources of each
    num_replicas: int = 1
    replica_num_cpus: float = 1.0
    replica_num_gpus: float = 0.0
    # custom Ray resources each replica reserves besides CPUs and GPUs: {name: amount}. Nodes started with
    # `ray start --resources='{"rollout_node": 8}'` and `{rollout_node: 1}` here keep the replicas on those nodes
    replica_resources: dict[str, float] = field(default_factory=dict)
    # fold the published LoRA into the replica's weights (W0 + α/r·B·A, once per version, from a kept copy of W0):
    # the generation runs no LoRA matmuls. The in-process engines, and vllm-omni for the families whose adapters it
    # serves through vLLM's LoRA layers (not BAGEL's); the merged forward rounds differently from the trainer's in
    # bf16, so old log-probs come from the trainer (train.old_logprob)
    merge_lora: bool = False
    # where the copy of the adapted base weights lives: "device" (a second copy in GPU memory; the fastest swap),
    # "host" (pinned host memory: no GPU memory, one host-to-GPU copy of those weights per version), or "auto" (the
    # device if the copy takes at most half the GPU's free memory at the first adapter, else the host). vllm-omni keeps
    # it on the host always (read from the checkpoint): auto or host
    merged_base_on: MergedBaseOn = MergedBaseOn("auto")
    # vllm-omni only: the prompt's context prefilled by a thinker stage (vLLM's AR worker) whose KV the DiT stage
    # takes, as vllm-omni's own two-stage deploy does for BAGEL (text to image only; CUDA only: vllm-omni has no AR
    # worker on the CPU platform). The trainer rebuilds each context from the recorded token ids
    thinker_stage: bool = False
    # concurrent requests one replica accepts (vllm-omni queues them and batches up to max_num_seqs per forward)
    max_ongoing_requests: int = 4
    max_num_seqs: int = 1
    # a group whose generation or reward failed (replica lost, engine error) is asked again this many times
    request_retries: int = 3

    def request(self, prompt: str, **fields: Any) -> GenerationRequest:
        """A request for one prompt group sampled as this section says; `fields` set anything else (seed,
        group_id, lora_version) or differ from it (n, size, steps, ...)."""
        guidance = fields.pop("guidance_scale", self.guidance_scale)
        negative = fields.pop("negative_prompt", self.negative_prompt)
        return GenerationRequest(
            prompt=prompt, n=fields.pop("n", self.group_size), height=fields.pop("height", self.height),
            width=fields.pop("width", self.width), num_frames=fields.pop("num_frames", self.num_frames),
            num_inference_steps=fields.pop("num_inference_steps", self.num_inference_steps),
            guidance_scale=guidance, negative_prompt=negative if guidance > 1 else None,
            embedded_guidance_scale=fields.pop("embedded_guidance_scale", self.embedded_guidance_scale),
            noise_level=fields.pop("noise_level", self.noise_level), sde_type=fields.pop("sde_type", self.sde_type),
            image_guidance_scale=fields.pop("image_guidance_scale", self.image_guidance_scale),
            cfg_interval=tuple(fields.pop("cfg_interval", self.cfg_interval)),
            cfg_renorm=str(fields.pop("cfg_renorm", self.cfg_renorm)),
            cfg_renorm_min=fields.pop("cfg_renorm_min", self.cfg_renorm_min),
            timestep_shift=fields.pop("timestep_shift", self.timestep_shift), **fields)


@dataclass
class ModelRewardConfig:
    """A reward computed by a model from a local folder (app/rewards/clip.py): real weights, or a tiny random build
    (`python -m jobs.make_tiny_models --preset tiny-clip`)."""

    # a transformers CLIPModel folder: PickScore_v1 (pickscore), openai/clip-vit-large-patch14 (clipscore, aesthetic)
    path: str | None = None
    # the processor's folder when the weights ship without one (PickScore_v1: CLIP-ViT-H-14-laion2B-s32B-b79K's)
    processor_path: str | None = None
    # aesthetic only: the LAION MLP head's state dict (sac+logos+ava1-l14-linearMSE.pth)
    head_path: str | None = None
    # images per forward in the reward replica
    batch_size: int = 16


@dataclass
class JudgeRewardConfig:
    """A VLM judge from a local folder (app/rewards/judge.py): Qwen2.5-VL or Qwen3-VL weights, or a tiny random build
    (`python -m jobs.make_tiny_models --preset tiny-judge`)."""

    # a transformers folder with the model, its processor and chat template (e.g. Qwen/Qwen2.5-VL-3B-Instruct)
    path: str | None = None
    # ocr: read the image's text greedily, scored as the OCR term; yesno: P(Yes) for "Does this image show ...?"
    mode: str = "ocr"
    # images per forward in the reward replica
    batch_size: int = 8
    # ocr: the longest reading (tokens)
    max_new_tokens: int = 32
    # the judge's own Serve deployment (`Judge`): every reward replica asks it
    num_replicas: int = 1
    replica_num_cpus: float = 1.0
    # a GPU share runs it in bf16; 0: CPUs, fp32
    replica_num_gpus: float = 0.0


@dataclass
class FramesConfig:
    """The frames of a video the image reward terms score; a video's score is their mean."""

    # frames 0, every, 2·every, ...: 1 scores every frame (the OCR reward reads each one it is given)
    every: int = 1


@dataclass
class RewardConfig:
    # reward name -> weight of the weighted sum ("ocr", "jpeg_compressibility", "pickscore", "clipscore",
    # "aesthetic", "vlm_judge"); a YAML file or a `reward.weights={...}` override replaces the whole mapping (exactly
    # the rewards named are used)
    weights: dict[str, float] = field(default_factory=lambda: {"ocr": 1.0})
    # the model-based terms' weights (read only when reward.weights names them)
    pickscore: ModelRewardConfig = field(default_factory=ModelRewardConfig)
    clipscore: ModelRewardConfig = field(default_factory=ModelRewardConfig)
    aesthetic: ModelRewardConfig = field(default_factory=ModelRewardConfig)
    vlm_judge: JudgeRewardConfig = field(default_factory=JudgeRewardConfig)
    # the OCR detector enlarges images whose shorter side is below this (RapidOCR's default 736); small images
    # read the same text without it at a fraction of the cost
    ocr_detect_min_side: int = DETECT_MIN_SIDE
    num_replicas: int = 1
    # CPUs of each replica; the OCR reward reads that many images at once (one engine per CPU)
    replica_num_cpus: float = 1.0
    # GPUs of each replica (a fraction shares one): the model-based terms run there in bf16, else on CPUs in fp32
    replica_num_gpus: float = 0.0
    # concurrent groups one replica scores in one call (Serve's @serve.batch)
    max_batch_size: int = 8
    # videos: which frames the image terms score (the terms that see time, temporal_consistency, see them all)
    frames: FramesConfig = field(default_factory=FramesConfig)


@dataclass
class ServeConfig:
    """The Serve application's own settings; it shares the model, rollout and reward sections with training."""

    # what one HTTP request may ask for (protects replicas from requests they cannot serve in time)
    max_n: int = 16
    max_side: int = 1024
    max_steps: int = 50
    max_frames: int = 129  # frames of one video (a video family's)
    max_reward_images: int = 64
    max_image_bytes: int = 8 * 2**20
    # a request body's bytes (JSON or an edit's form, images included): beyond it a 413 before anything is read
    max_body_bytes: int = 64 * 2**20
    # CPUs of the HTTP ingress replica
    api_num_cpus: float = 0.25
    # torch threads of each rollout and reward replica (replicas share cores: more threads oversubscribe them)
    replica_torch_threads: int = 1
    # replicas' log level (Serve, vllm); WARNING also drops Serve's per-request access log.
    # None: INFO for `serve run`; a training run follows logging.verbose
    log_level: LogLevel | None = None
    # API keys (docs/serving.md "Serving to a team"): the environment variable that holds them (comma-separated),
    # read where the application is built (`serve run`'s shell), never written into a config; and/or a file of
    # them, one a line. Set: every route but /v1/health needs `Authorization: Bearer <key>` (a 401 otherwise)
    api_key_env: str = "FLOWGRPO_API_KEY"
    api_key_file: str | None = None
    # backpressure: requests each caller (the HTTP ingress, a trainer) may queue for the rollout and reward replicas
    # once every replica holds its max_ongoing_requests; beyond it the HTTP API answers 503 with Retry-After
    # (retry_after_s) at once instead of queueing without end. -1: no bound (Serve's default)
    max_queued_requests: int = -1
    retry_after_s: float = 5.0


@dataclass
class TrainConfig:
    # optimizer steps of the whole run
    num_steps: int = 300
    # prompt groups sampled per optimizer step, over all workers
    groups_per_step: int = 16
    learning_rate: float = 1e-4
    weight_decay: float = 1e-4
    max_grad_norm: float = 1.0
    # PPO clip range ε on the likelihood ratio (FlowGRPO uses a tiny one)
    clip_range: float = 1e-4
    # β of the KL to the reference policy (the transformer with the adapter disabled)
    kl_beta: float = 0.04
    # advantages: "group" std (GRPO) or "batch" std (FlowGRPO global_std); clipped to ±adv_clip_max
    adv_std_mode: AdvStdMode = AdvStdMode.group
    adv_clip_max: float = 5.0
    # fraction of the T denoising steps trained per sample (FlowGRPO timestep_fraction)
    timestep_fraction: float = 1.0
    # recompute each transformer block's activations in the backward pass: far less memory for ~1/3 more compute
    # (real sizes need it; the tiny model does not)
    gradient_checkpointing: bool = False
    # optimizer steps per batch of rollouts (one per pass; passes after the first are off-policy and clipped)
    num_inner_epochs: int = 1
    # samples of one prompt group per forward/backward on one worker (divides rollout.group_size)
    micro_batch_size: int = 4
    # old log-probs (the ratio's denominator): "rollout" (as returned by the engine), "recompute" (one extra
    # forward of the policy before the update) or "trainer" (the first pass's own forward, detached: free, and
    # exact when compiled). With "trainer" the rollout's log-probs weigh each term as the behaviour policy's:
    # w = min(π_step / π_rollout, behaviour_weight_max) (decoupled PPO), 1 where the engine matches exactly
    old_logprob: OldLogprob = OldLogprob.rollout
    # the truncation C of the behaviour weight (train.old_logprob: trainer)
    behaviour_weight_max: float = 2.0
    # with model.compile: the share of activations compile's min-cut partitioner keeps for the backward (it
    # recomputes the cheapest of the rest), instead of gradient_checkpointing's whole-block recompute. null: off
    activation_memory_budget: float | None = None
    # FSDP2's reshard_after_forward for each block: true frees a block's gathered weights after its forward and
    # gathers them again for the backward; false keeps them (one all-gather less per block and pass, the whole
    # unsharded model's memory while a pass runs). Only with several ranks, where the base is sharded
    reshard_after_forward: bool = True
    # AdamW's fused CUDA kernel for the LoRA parameters (on GPUs; CPUs use the default implementation)
    fused_optimizer: bool = True
    # adapter versions a trained group may lag behind the policy. 0: strictly on-policy (each step waits for
    # groups of the adapter it just published). k >= 1: the groups of the next k steps are generated while this
    # step trains, with the adapter the replicas have; a group more than k versions old is regenerated. The
    # importance ratio is taken against the rollout's own log-probs (the behaviour policy), clipped as usual
    max_staleness: int = 0
    # score "cps" and the KL as flow_grpo / verl-omni do (to reproduce their runs); see app/algo/sde.py
    flow_grpo_compat: bool = False
    # seeds the LoRA init, prompt order, rollout noise and trained timesteps: a run is reproducible from it
    seed: int = 0
    # save a checkpoint (adapter, optimizer, step, RNG, data position) every this many steps (0: only at the end)
    checkpoint_every: int = 50
    # keep only the latest this many checkpoints (null: every one); each holds the LoRA and its optimizer state
    checkpoints_to_keep: int | None = None
    # a training worker that dies (node lost, OOM) restarts the worker group from the latest checkpoint this many
    # times per run (Ray Train FailureConfig); 0 lets the first failure end the run
    max_failures: int = 2


@dataclass
class DataConfig:
    # prompt source: a text file with one prompt per line, or a built-in set name ("ocr_tiny")
    prompts: str = MISSING
    shuffle: bool = True


def _default_bands() -> dict[str, list[float]]:
    from app.eval.sentinels import DEFAULT_BANDS

    return {k: list(v) for k, v in DEFAULT_BANDS.items()}


@dataclass
class EvalConfig:
    """Held-out evaluation (app/eval/): during training every `every` steps, and by `python -m jobs.evaluate`.
    Deterministic by default (noise_level 0, one fixed seed per prompt): every evaluation of a run sees the same
    noise, so two evaluations differ only by the adapter. The sampling settings left null are the rollout's."""

    # evaluate the adapter every this many optimizer steps (0: never during training; jobs.evaluate still works)
    every: int = 0
    # evaluate the base model before the first step too (with sentinels on, its images are made anyway: they are
    # what the sentinels compare with)
    before_train: bool = False
    # eval set: a built-in one (ocr_eval: 512 held-out OCR prompts; ocr_eval_tiny; ocr_edit_eval, ocr_edit_eval_tiny:
    # edits, BAGEL) or a file in data.prompts' formats
    prompts: str = "ocr_eval"
    # use the first this many prompts of the set (null: all)
    max_prompts: int | None = None
    images_per_prompt: int = 1
    # the eval seeds: prompt k's images always start from the noise of (seed, k), whatever the run's train.seed
    seed: int = 0
    # η of the sampler: 0 is the deterministic ODE
    noise_level: float = 0.0
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    # may differ from the rollout's: train at a small size, evaluate at the size that matters
    height: int | None = None
    width: int | None = None
    # prompts shown in the eval grid (the first ones of the set, the same every evaluation)
    grid_prompts: int = 8
    # sentinels: image statistics against the base model's images of the same prompts and seeds (made once per
    # run), and the band of each change outside which a warning is printed (app/eval/sentinels.py)
    sentinels: bool = True
    sentinel_bands: dict[str, Any] = field(default_factory=_default_bands)  # name -> [lo, hi] (Any: [0, 1] is fine)

    @property
    def enabled(self) -> bool:
        """Whether a training run evaluates at all."""
        return self.every > 0 or self.before_train


@dataclass
class LoggingConfig:
    # run folder: tensorboard events, checkpoints, image grids, reward curve
    dir: str = "runs/default"
    image_every: int = 10
    # false: the console shows the start-up summary, one line per step and the final summary (errors and real
    # warnings too); true: also Ray Train's per-report dicts and the INFO logs of Ray, Serve, vllm and vllm-omni
    verbose: bool = False


@dataclass
class ClusterConfig:
    # Ray address ("auto" for an existing cluster); None starts a local one
    address: str | None = None
    # Ray Train workers (FSDP2 ranks) and the resources of each
    num_workers: int = 1
    use_gpu: bool = False
    worker_num_cpus: float = 1.0
    # GPUs of each worker (with use_gpu); a fraction shares a GPU with a rollout replica (one-GPU machines)
    worker_num_gpus: float = 1.0
    # custom Ray resources each worker reserves besides CPUs and GPUs (as rollout.replica_resources): e.g.
    # {trainer_node: 1} keeps the FSDP2 ranks on the nodes that have that resource
    worker_resources: dict[str, float] = field(default_factory=dict)
    # Serve's HTTP port on this cluster (the rollout/reward API stays reachable while training)
    serve_port: int = 8000


@dataclass
class AppConfig:
    """The Serve application (`serve run serve_config.yaml`, whose `args:` are these sections): the run config's
    model, rollout and reward sections, bound whole to the deployments, and the serve section."""

    model: ModelConfig = field(default_factory=ModelConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    serve: ServeConfig = field(default_factory=ServeConfig)

    def __post_init__(self) -> None:
        _check_app(self)


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    # the rollout/reward application the run deploys (its HTTP API stays up while training)
    serve: ServeConfig = field(default_factory=ServeConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    def __post_init__(self) -> None:
        _check_app(self)
        _check_run(self)
        _check_eval(self)

    def app(self) -> AppConfig:
        return AppConfig(model=self.model, rollout=self.rollout, reward=self.reward, serve=self.serve)

    def resources(self) -> dict[str, dict[str, float]]:
        """What the run's processes reserve on the Ray cluster, part by part: {part: {"CPU": n, "GPU": n, custom
        resource: n}} (the Serve application's deployments and the training workers; Ray's and Serve's own actors
        take none)."""
        ro, rw, cl = self.rollout, self.reward, self.cluster
        return {
            f"rollout ({ro.num_replicas} x rollout.replica_num_cpus/gpus/resources)":
                {"CPU": ro.num_replicas * ro.replica_num_cpus, "GPU": ro.num_replicas * ro.replica_num_gpus,
                 **{k: ro.num_replicas * v for k, v in ro.replica_resources.items()}},
            f"reward ({rw.num_replicas} x reward.replica_num_cpus/gpus)":
                {"CPU": rw.num_replicas * rw.replica_num_cpus, "GPU": rw.num_replicas * rw.replica_num_gpus},
            **({f"judge ({rw.vlm_judge.num_replicas} x reward.vlm_judge.replica_num_cpus/gpus)":
                {"CPU": rw.vlm_judge.num_replicas * rw.vlm_judge.replica_num_cpus,
                 "GPU": rw.vlm_judge.num_replicas * rw.vlm_judge.replica_num_gpus}} if "vlm_judge" in rw.weights
               else {}),
            "HTTP ingress (serve.api_num_cpus)": {"CPU": self.serve.api_num_cpus},
            f"training ({cl.num_workers} x cluster.worker_num_cpus/gpus/resources)":
                {"CPU": cl.num_workers * cl.worker_num_cpus,
                 "GPU": cl.num_workers * cl.worker_num_gpus if cl.use_gpu else 0.0,
                 **{k: cl.num_workers * v for k, v in cl.worker_resources.items()}},
        }


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _check_custom_resources(key: str, resources: dict[str, float], prefix: str) -> None:
    for name, amount in resources.items():
        _require(name not in ("CPU", "GPU", "memory", "object_store_memory"),
                 f"{key}: {name} is not a custom resource; set {prefix}{name.lower()}s instead"
                 if name in ("CPU", "GPU") else f"{key}: {name} is Ray's own; name a custom resource")
        _require(amount > 0, f"{key}: {name}={amount} must be > 0")


def _check_app(config: AppConfig | RunConfig) -> None:
    """The sections a Serve application is built from (a RunConfig has them too)."""
    model, rollout, reward, serve = config.model, config.rollout, config.reward, config.serve
    _require(model.lora_rank >= 1, f"model.lora_rank={model.lora_rank} must be >= 1")
    _require(model.attention_kernels is None or (len(model.attention_kernels) > 0 and all(
        k in SDPA_KERNELS for k in model.attention_kernels)),
             f"model.attention_kernels={model.attention_kernels}: name one or more of {list(SDPA_KERNELS)} (or null: "
             "torch's choice)")
    # the VAE's attention (a head of 384 in Qwen-Image's) fits no fast kernel: without math torch fails the decode
    # ("Invalid backend") after a whole denoise; with it, each allowed kernel still takes every input it can
    _require(model.attention_kernels is None or "math" in model.attention_kernels,
             f"model.attention_kernels={model.attention_kernels}: add math, the fallback for the attention the others "
             "cannot take (the VAE's), e.g. [flash, math]")
    engines = get_family(model.family).engines
    mode = str(model.compile.mode)
    if mode in CUDA_GRAPH_MODES:
        _require(get_family(model.family).cuda_graphs,
                 f"model.compile.mode={mode} replays the engine's blocks as CUDA graphs, whose next replay overwrites "
                 f"what a block returned; model.family={model.family} keeps that across forwards (the context's "
                 f"keys and values): use {CUDA_GRAPH_MODES[mode]}")
    _require(rollout.engine in engines,
             f"rollout.engine={rollout.engine} cannot run model.family={model.family}: use one of {list(engines)}")
    others = [e for e in engines if e != Engine.vllm_omni]
    _require(rollout.engine != Engine.vllm_omni or get_family(model.family).vllm_omni.pipeline_class is not None,
             f"rollout.engine=vllm_omni: the FlowGRPO pipeline of model.family={model.family} on vllm-omni (trajectory "
             f"recording) is not there yet; use rollout.engine={' or '.join(others)}")
    _require(not rollout.merge_lora or rollout.engine != Engine.vllm_omni
             or get_family(model.family).vllm_omni.lora_delivery == "vllm_manager",
             f"rollout.merge_lora: vllm-omni's {model.family} pipeline applies its adapter with its own hooks and "
             "cannot fold it in; use rollout.merge_lora=false, or the in-process engine (rollout.engine=bagel)")
    _require(not rollout.merge_lora or rollout.engine != Engine.vllm_omni
             or rollout.merged_base_on != MergedBaseOn.device,
             "rollout.merged_base_on=device: the vllm_omni engine keeps the adapted base weights in host memory "
             "(read from the checkpoint); use auto or host")
    distilled = get_family(model.family).embedded_guidance
    _require((rollout.embedded_guidance_scale is not None) == distilled,
             f"rollout.embedded_guidance_scale={rollout.embedded_guidance_scale}: model.family={model.family} "
             + ("is guidance-distilled: set its guidance input (3.5 for FLUX.1-dev)" if distilled else
                "takes no guidance input: leave it null (rollout.guidance_scale is its CFG)"))
    _require(not rollout.thinker_stage or (rollout.engine == Engine.vllm_omni
                                            and get_family(model.family).vllm_omni.thinker_deploy_config),
             f"rollout.thinker_stage: a thinker stage is vllm-omni's two-stage deploy of BAGEL; model.family="
             f"{model.family} with rollout.engine={rollout.engine} has none: use rollout.thinker_stage=false")
    window = rollout.sde_window
    _require(0 <= window.size <= rollout.num_inference_steps,
             f"rollout.sde_window.size={window.size} must be in [0, rollout.num_inference_steps="
             f"{rollout.num_inference_steps}] (0: no window)")
    _require(window.start >= 0 and window.every >= 1 and window.stride >= 0,
             f"rollout.sde_window: start={window.start} must be >= 0, every={window.every} >= 1, "
             f"stride={window.stride} >= 0")
    _require(window.range is None or (len(window.range) == 2 and window.range[0] >= 0
                                      and window.range[0] + window.size <= window.range[1]
                                      <= rollout.num_inference_steps),
             f"rollout.sde_window.range={window.range} must be [lo, hi] with 0 <= lo, lo + size ({window.size}) "
             f"<= hi <= rollout.num_inference_steps={rollout.num_inference_steps} (or null: anywhere)")
    _require(window.placement != WindowPlacement.fixed or window.start + window.size <= rollout.num_inference_steps,
             f"rollout.sde_window: a fixed window of {window.size} steps from start={window.start} does not fit in "
             f"{rollout.num_inference_steps} steps")
    _check_ode_steps(rollout)
    _check_as_request(rollout)
    # videos or images: the family's rule (GenerationRequest knows no family)
    frames_problem = get_family(model.family).request_problem(rollout.request("a placeholder prompt"))
    _require(frames_problem is None,
             f"rollout.num_frames={rollout.num_frames}: {frames_problem[1] if frames_problem else ''}")
    for name in ("num_replicas", "max_ongoing_requests", "max_num_seqs"):
        _require(getattr(rollout, name) >= 1, f"rollout.{name}={getattr(rollout, name)} must be >= 1")
    _require(rollout.replica_num_cpus > 0 and rollout.replica_num_gpus >= 0,
             f"rollout.replica_num_cpus={rollout.replica_num_cpus} must be > 0 and "
             f"rollout.replica_num_gpus={rollout.replica_num_gpus} >= 0")
    _check_custom_resources("rollout.replica_resources", rollout.replica_resources, "rollout.replica_num_")
    _require(bool(reward.weights), "reward.weights is empty: name at least one reward, e.g. {ocr: 1.0}")
    unknown = sorted(set(reward.weights) - set(REWARD_NAMES))
    _require(not unknown, f"reward.weights names unknown rewards {unknown}: known are {list(REWARD_NAMES)}")
    timed = sorted(set(reward.weights) & set(VIDEO_REWARDS))
    _require(not timed or get_family(model.family).video,
             f"reward.weights names {timed}: it scores videos, and model.family={model.family} generates images")
    _require(reward.frames.every >= 1, f"reward.frames.every={reward.frames.every} must be >= 1 (1: every frame)")
    for name in MODEL_REWARDS:
        if name in reward.weights:
            section = getattr(reward, name)
            _require(section.path is not None,
                     f"reward.weights names {name}: set reward.{name}.path to a local folder with its CLIPModel "
                     f"({MODEL_REWARDS[name]})")
            _require(name != "aesthetic" or section.head_path is not None,
                     "reward.weights names aesthetic: set reward.aesthetic.head_path to the LAION head's state dict "
                     "(sac+logos+ava1-l14-linearMSE.pth)")
            _require(section.batch_size >= 1, f"reward.{name}.batch_size={section.batch_size} must be >= 1")
    if "vlm_judge" in reward.weights:
        judge = reward.vlm_judge
        _require(judge.path is not None, "reward.weights names vlm_judge: set reward.vlm_judge.path to a local folder "
                 "with a Qwen2.5-VL or Qwen3-VL judge (model, processor, chat template)")
        _require(judge.mode in ("ocr", "yesno"), f"reward.vlm_judge.mode={judge.mode!r} must be ocr or yesno")
        _require(judge.batch_size >= 1 and judge.max_new_tokens >= 1 and judge.num_replicas >= 1,
                 f"reward.vlm_judge.batch_size={judge.batch_size}, max_new_tokens={judge.max_new_tokens} and "
                 f"num_replicas={judge.num_replicas} must be >= 1")
        _require(judge.replica_num_cpus > 0 and judge.replica_num_gpus >= 0,
                 f"reward.vlm_judge.replica_num_cpus={judge.replica_num_cpus} must be > 0 and replica_num_gpus="
                 f"{judge.replica_num_gpus} >= 0")
    _require(reward.replica_num_gpus >= 0, f"reward.replica_num_gpus={reward.replica_num_gpus} must be >= 0")
    _require(reward.ocr_detect_min_side >= 32,
             f"reward.ocr_detect_min_side={reward.ocr_detect_min_side} must be >= 32 (the OCR detector's least)")
    _require(reward.num_replicas >= 1 and reward.max_batch_size >= 1 and reward.replica_num_cpus > 0,
             f"reward.num_replicas={reward.num_replicas} and reward.max_batch_size={reward.max_batch_size} "
             "must be >= 1, "
             f"reward.replica_num_cpus={reward.replica_num_cpus} > 0")
    for name in ("max_n", "max_side", "max_steps", "max_reward_images", "max_image_bytes", "replica_torch_threads"):
        _require(getattr(serve, name) >= 1, f"serve.{name}={getattr(serve, name)} must be >= 1")
    _require(serve.api_num_cpus > 0, f"serve.api_num_cpus={serve.api_num_cpus} must be > 0")
    # a request that leaves size or steps out gets the rollout section's: the limits must admit them
    _require(max(rollout.height, rollout.width) <= serve.max_side,
             f"serve.max_side={serve.max_side} is below rollout's {rollout.width}x{rollout.height}, the size of "
             "a request that names none: raise serve.max_side")
    _require(rollout.num_inference_steps <= serve.max_steps,
             f"serve.max_steps={serve.max_steps} is below rollout.num_inference_steps="
             f"{rollout.num_inference_steps}, the steps of a request that names none: raise serve.max_steps")


# the request fields a rollout section sets under another name
_SECTION_KEYS = {"n": "group_size"}


def _check_ode_steps(rollout: RolloutConfig) -> None:
    from app.rollout.ode_steps import CACHES, PRECISIONS, SCALINGS

    ode = rollout.ode_steps
    _require(ode.cache in CACHES, f"rollout.ode_steps.cache={ode.cache!r}: use one of {list(CACHES)}")
    _require(ode.precision in PRECISIONS,
             f"rollout.ode_steps.precision={ode.precision!r}: use one of {list(PRECISIONS)}")
    _require(ode.fp8_scaling in SCALINGS,
             f"rollout.ode_steps.fp8_scaling={ode.fp8_scaling!r}: use one of {list(SCALINGS)}")
    _require(ode.precision == "fp8" or (ode.fp8_scaling == "rowwise" and not ode.fp8_fast_accum),
             f"rollout.ode_steps.fp8_scaling={ode.fp8_scaling}, fp8_fast_accum={ode.fp8_fast_accum}: they shape "
             "FP8 matmuls: set rollout.ode_steps.precision=fp8 too, or leave them at rowwise and false")
    on = [f"{key}={value}" for key, value, off in (("cache", ode.cache, "none"), ("precision", ode.precision, "model"))
          if value != off]
    if not on:
        return
    what = "rollout.ode_steps." + ", ".join(on)
    if ode.cache != "none":
        _require(ode.threshold > 0,
                 f"rollout.ode_steps.threshold={ode.threshold} must be > 0 (0.05: diffusers' default)")
    _require(rollout.engine == Engine.diffusers,
             f"{what}: the in-process diffusers engines make their ODE steps cheaper; rollout.engine="
             f"{rollout.engine} does not: use rollout.engine=diffusers or leave rollout.ode_steps off")
    _require(0 < rollout.sde_window.size < rollout.num_inference_steps,
             f"{what}: every step is an SDE step (rollout.sde_window.size={rollout.sde_window.size} of "
             f"{rollout.num_inference_steps}), none is left to make cheaper: set an SDE window (e.g. "
             "rollout.sde_window.size=2) or leave rollout.ode_steps off")


def _check_as_request(rollout: RolloutConfig) -> None:
    """The per-request rules (sizes, steps, noise, guidance, BAGEL's CFG settings, the window) live in
    GenerationRequest alone: the section is checked by building the request it produces for a group, with the
    window it places for the run's first group, and an error names the section's key."""
    window = rollout.sde_window.window(rollout.num_inference_steps, seed=0, group=0, step=0)
    try:
        rollout.request("a placeholder prompt", sde_window=window)
    except RequestError as err:
        key = _SECTION_KEYS.get(err.field, err.field)
        raise ConfigError(f"rollout.{key}={err.value!r}: {err.why}") from None


def _check_run(config: RunConfig) -> None:
    rollout, train, cluster = config.rollout, config.train, config.cluster
    _require(rollout.group_size >= 2,
             f"rollout.group_size={rollout.group_size} must be >= 2: advantages compare a group's images")
    _require(rollout.request_retries >= 0, f"rollout.request_retries={rollout.request_retries} must be >= 0")
    _require(train.max_failures >= -1, f"train.max_failures={train.max_failures} must be >= 0 (or -1: no limit)")
    _require(0 < train.timestep_fraction <= 1, f"train.timestep_fraction={train.timestep_fraction} must be in (0, 1]")
    _require(train.clip_range > 0, f"train.clip_range={train.clip_range} must be > 0")
    _require(train.kl_beta >= 0, f"train.kl_beta={train.kl_beta} must be >= 0")
    _require(cluster.num_workers >= 1, f"cluster.num_workers={cluster.num_workers} must be >= 1")
    _require(0 < cluster.worker_num_gpus <= 1 or float(cluster.worker_num_gpus).is_integer(),
             f"cluster.worker_num_gpus={cluster.worker_num_gpus} must be a fraction in (0, 1] or a whole number")
    _check_custom_resources("cluster.worker_resources", cluster.worker_resources, "cluster.worker_num_")
    _require(train.groups_per_step % cluster.num_workers == 0,
             f"train.groups_per_step={train.groups_per_step} must be divisible by "
             f"cluster.num_workers={cluster.num_workers} "
             "(each worker requests the same number of groups)")
    _require(train.micro_batch_size >= 1 and rollout.group_size % train.micro_batch_size == 0,
             f"train.micro_batch_size={train.micro_batch_size} must divide rollout.group_size={rollout.group_size} "
             "(a micro-batch holds images of one prompt group, which share the prompt embeddings)")
    _require(train.num_inner_epochs >= 1, f"train.num_inner_epochs={train.num_inner_epochs} must be >= 1")
    _require(train.max_staleness >= 0, f"train.max_staleness={train.max_staleness} must be >= 0 (0: on-policy)")
    _require(train.max_staleness == 0 or train.old_logprob != OldLogprob.recompute,
             f"train.max_staleness={train.max_staleness} weighs a stale group by the rollout's log-probs (the policy "
             "that sampled it, which the trainer no longer has): it needs train.old_logprob=rollout or trainer")
    _require(train.old_logprob != OldLogprob.trainer or train.num_inner_epochs == 1,
             f"train.old_logprob=trainer takes old log-probs from the first pass itself; with train.num_inner_epochs="
             f"{train.num_inner_epochs} later passes need them before the update: set train.old_logprob=recompute")
    _require(train.behaviour_weight_max >= 1,
             f"train.behaviour_weight_max={train.behaviour_weight_max} must be >= 1 (1: no upweighting)")
    compiled = config.model.compile
    _require(not compiled.enabled or train.old_logprob != OldLogprob.rollout,
             "model.compile.enabled: a compiled forward with gradients (the trainer's) differs in the last bits from "
             "one without (the rollout's), far above train.clip_range: set train.old_logprob=trainer (free: the "
             "first pass scores its own old log-probs) or recompute (one more forward)")
    _require(train.activation_memory_budget is None or (compiled.enabled and 0 < train.activation_memory_budget <= 1
                                                         and not train.gradient_checkpointing),
             f"train.activation_memory_budget={train.activation_memory_budget} must be in (0, 1], with "
             "model.compile.enabled and train.gradient_checkpointing off (it replaces the whole-block recompute)")
    _require(train.num_steps >= 0, f"train.num_steps={train.num_steps} must be >= 0")
    _require(train.checkpoint_every >= 0, f"train.checkpoint_every={train.checkpoint_every} must be >= 0")
    _require(train.checkpoints_to_keep is None or train.checkpoints_to_keep >= 1,
             f"train.checkpoints_to_keep={train.checkpoints_to_keep} must be >= 1, or null to keep every checkpoint")
    _require(train.learning_rate >= 0, f"train.learning_rate={train.learning_rate} must be >= 0")
    _require(rollout.noise_level > 0 or train.num_steps == 0,
             "rollout.noise_level=0 samples the deterministic ODE: there is nothing to train; set it > 0")
    _require(not rollout.merge_lora or train.old_logprob != OldLogprob.rollout,
             "rollout.merge_lora: the merged weights round differently from the trainer's adapter in bf16, so the "
             "rollout's log-probs are not the trainer's: set train.old_logprob=trainer (free) or recompute")
    exact = get_family(config.model.family).exact_engines
    _require(rollout.engine in exact or train.old_logprob != OldLogprob.rollout,
             f"rollout.engine={rollout.engine} does not reproduce the trainer's log-probs of model.family="
             f"{config.model.family} exactly: set train.old_logprob=trainer or recompute (or rollout.engine="
             f"{exact[0]}, which matches exactly)")


def eval_request(config: RunConfig, prompt, seed: int, lora_version: int | None) -> GenerationRequest:
    """The request of one eval prompt: the eval section's sampling, the rollout section's where it is null, no SDE
    window, one image per `eval.images_per_prompt`, an edit prompt's image."""
    import torch

    ev = config.eval
    unset = {"num_inference_steps": ev.num_inference_steps, "guidance_scale": ev.guidance_scale,
             "height": ev.height, "width": ev.width}
    image = getattr(prompt, "image", None)
    return config.rollout.request(str(prompt), n=ev.images_per_prompt, noise_level=ev.noise_level, seed=seed,
                                  lora_version=lora_version, **{k: v for k, v in unset.items() if v is not None},
                                  **({"image": torch.from_numpy(image)} if image is not None else {}))


def _check_eval(config: RunConfig) -> None:
    ev = config.eval
    _require(ev.every >= 0, f"eval.every={ev.every} must be >= 0 (0: no evaluation during training)")
    _require(ev.images_per_prompt >= 1, f"eval.images_per_prompt={ev.images_per_prompt} must be >= 1")
    _require(ev.max_prompts is None or ev.max_prompts >= 1, f"eval.max_prompts={ev.max_prompts} must be >= 1 or null")
    _require(ev.grid_prompts >= 0, f"eval.grid_prompts={ev.grid_prompts} must be >= 0")
    from app.eval.sentinels import DEFAULT_BANDS

    for name, band in ev.sentinel_bands.items():
        _require(name in DEFAULT_BANDS, f"eval.sentinel_bands.{name}: no such sentinel; the banded ones are "
                                        f"{list(DEFAULT_BANDS)}")
        _require(isinstance(band, list) and len(band) == 2
                 and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in band) and band[0] <= band[1],
                 f"eval.sentinel_bands.{name}={band} must be [lo, hi], two numbers with lo <= hi")
    serve = config.serve
    size = (ev.height or config.rollout.height, ev.width or config.rollout.width)
    _require(max(size) <= serve.max_side and (ev.num_inference_steps or 0) <= serve.max_steps,
             f"eval: {size[1]}x{size[0]} and {ev.num_inference_steps} steps must be within serve.max_side="
             f"{serve.max_side} and serve.max_steps={serve.max_steps}: raise those")
    try:
        eval_request(config, "a placeholder prompt", seed=0, lora_version=None)
    except RequestError as err:
        key = {"n": "images_per_prompt"}.get(err.field, err.field)
        raise ConfigError(f"eval.{key}={err.value!r}: {err.why}") from None


def _format_omegaconf_error(err: OmegaConfBaseException, source: str) -> str:
    key = getattr(err, "full_key", None) or "?"
    msg = str(err).splitlines()[0]
    return f"{source}: invalid config key '{key}': {msg}"


# settings whose value is a mapping: a YAML file or an override that sets one replaces it whole (OmegaConf merges
# mappings key by key, so `{jpeg_compressibility: 1.0}` over the default `{ocr: 1.0}` would train on both);
# `reward.weights.ocr=0.5` still edits a single entry
REPLACED_MAPPINGS = ("reward.weights",)  # (eval.sentinel_bands merges: a band given replaces that band only)


def _replaced(layer) -> list[str]:
    return [k for k in REPLACED_MAPPINGS if OmegaConf.select(layer, k) is not None]


def _layers(path, overrides) -> list[tuple[str, Any, list[str]]]:
    """(source, config layer, mapping settings it replaces) in merge order: the YAML, then each override."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form key=value (e.g. train.learning_rate=3e-4)")
    layers = []
    try:
        if path is not None:
            if not Path(path).expanduser().is_file():
                raise ConfigError(f"--config {path}: no such file (configs/ holds the project's configs, e.g. "
                                  "configs/tiny_cpu.yaml)")
            yaml = OmegaConf.load(Path(path).expanduser())
            layers.append((str(path), yaml, _replaced(yaml)))
        for item in overrides:
            key = item.split("=", 1)[0].strip()
            layers.append(("overrides", OmegaConf.from_dotlist([item]), [key] if key in REPLACED_MAPPINGS else []))
    except OmegaConfBaseException as err:
        raise ConfigError(_format_omegaconf_error(err, "overrides" if layers or path is None else str(path))) from None
    return layers


def load(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """The run config from a YAML file (optional) and `key=value` overrides, validated."""
    return _merged(RunConfig, _layers(path, overrides), str(path or "overrides"))


def load_app(args: Mapping | AppConfig) -> AppConfig:
    """The Serve application's config from serve_config.yaml's `args:` (sections model, rollout, reward, serve),
    validated as a run config's sections are."""
    if isinstance(args, AppConfig):
        return args
    source = "the application's args"
    try:
        layer = OmegaConf.create(dict(args))
    except OmegaConfBaseException as err:
        raise ConfigError(_format_omegaconf_error(err, source)) from None
    return _merged(AppConfig, [(source, layer, _replaced(layer))], source)


def _merged(schema: type, layers: list[tuple[str, Any, list[str]]], source: str):
    merged: Any = OmegaConf.structured(schema)  # the class, not an instance: no checks before values merge
    for origin, layer, replaced in layers:
        try:
            for key in replaced:
                OmegaConf.update(merged, key, {}, merge=False)
            merged = OmegaConf.merge(merged, layer)
        except OmegaConfBaseException as err:
            raise ConfigError(_format_omegaconf_error(err, origin)) from None
    missing = sorted(OmegaConf.missing_keys(merged))
    if missing:
        raise ConfigError(f"required config values are not set: {', '.join(missing)} (set them in the YAML or as "
                          "key=value overrides)")
    try:
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as err:
        raise ConfigError(_format_omegaconf_error(err, source)) from None


def to_yaml(config: RunConfig) -> str:
    """The resolved config as YAML (saved next to every run)."""
    return OmegaConf.to_yaml(OmegaConf.structured(config))
