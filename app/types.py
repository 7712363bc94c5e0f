"""The records passed between rollout, reward and trainer.

`GenerationRequest` asks for one prompt group; it is validated when constructed, so a bad request fails before
any engine sees it. `Trajectory` is what comes back: the images and everything the trainer needs to score the
same steps again (latents visited, schedule, log-probs, the prompt embeddings actually used), so nothing is
recomputed by guessing. `LoraAdapter` is a LoRA of the transformer in peft/diffusers naming, in memory.

Every model family shares the records (`Trajectory.family` names it). A family conditions either on text-encoder
states (`prompt_embeds`: Qwen-Image; SD3 adds its pooled embedding in `conditioning`) or on a context its own model
builds from token ids and, for an edit, the input image (`conditioning`: BAGEL), which the trainer rebuilds under
the current LoRA.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import KW_ONLY, dataclass, field

import torch

from app.algo.sde import SDE_TYPES
from app.algo.sde_window import noise_levels, stochastic_steps
from app.image_size import side_problem

MAX_GROUP_SIZE = 256
MAX_SEED = 2**63 - 1
MAX_EDIT_PIXELS = 4096 * 4096
MAX_FRAMES = 257  # frames of one video (Wan's 81 at 16 fps is 5 s; 257 is 16 s)
# BAGEL's renormalisations of the guided velocity (app/models/bagel.py combine_cfg); app.config.CfgRenorm is
# built from it
CFG_RENORMS = ("global", "channel", "text_channel")


class RequestError(ValueError):
    """A `GenerationRequest` field that cannot be sampled: `field` names it (the request's own field name), `value`
    is what it held, and the message says what to change. Raised wherever a request is checked (its constructor,
    a rollout replica), so the HTTP API and the config can name the field without reading the message."""

    def __init__(self, field: str, value, why: str):
        super().__init__(f"{field}={value!r}: {why}")
        self.field, self.value, self.why = field, value, why

    def __reduce__(self):
        # rebuilt from its parts when Ray carries it from a replica (the default would call __init__(message))
        return type(self), (self.field, self.value, self.why)


def _fail(name: str, value, why: str) -> None:
    raise RequestError(name, value, why)


@dataclass(frozen=True)
class GenerationRequest:
    """One prompt group: `n` images of `prompt`, sampled with the FlowGRPO SDE. The sampling settings have no
    defaults here: `RolloutConfig.request` fills them from a config's rollout section, their one home."""

    prompt: str
    _: KW_ONLY
    height: int
    width: int
    # denoising steps T
    num_inference_steps: int
    # η of the SDE; 0 samples the ODE (deterministic, nothing to train on)
    noise_level: float
    sde_type: str
    # images in the group (the GRPO group size); videos for a video family
    n: int = 1
    # frames of each video: a video family requires it (its own rule too: Wan's 4k + 1), an image family refuses it
    num_frames: int | None = None
    # the SDE window [first, last + 1) of denoising steps sampled with noise; the other steps take the ODE step
    # (app/algo/sde_window.py). None: every step is stochastic
    sde_window: tuple[int, int] | None = None
    # text CFG (Qwen-Image true CFG, BAGEL cfg_text_scale); > 1 needs a negative prompt (BAGEL: "" = the empty
    # context, its default)
    guidance_scale: float = 1.0
    negative_prompt: str | None = None
    # a guidance-distilled model's guidance input (FLUX.1-dev's guidance embedding, 3.5 in the field's recipes): one
    # forward a step, no negative branch; None for a model without one
    embedded_guidance_scale: float | None = None
    # the image to edit, uint8 [H, W, 3]; None: text to image (BAGEL only)
    image: torch.Tensor | None = None
    # BAGEL's other sampling settings (Qwen-Image ignores them): image CFG of an edit (cfg_img_scale), the σ
    # interval (lo, hi] where CFG applies, the renormalisation of the guided velocity, the schedule's shift
    image_guidance_scale: float = 1.0
    cfg_interval: tuple[float, float] = (0.0, 1.0)
    cfg_renorm: str = "global"
    cfg_renorm_min: float = 0.0
    timestep_shift: float = 3.0
    # seeds the whole group (initial noise and every SDE step); None: the engine draws one and records it
    seed: int | None = None
    # index of the group's first image: a per-sample request for image j of a group sets n=1, sample_offset=j
    sample_offset: int = 0
    # the trainer's index of the prompt group (its position in the run's prompt stream); None for ad-hoc requests
    group_id: int | None = None
    # the adapter version the group must be sampled with (a replica serving another one loads the published
    # adapter first, or refuses); None: whatever the replica serves
    lora_version: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.prompt, str) or not self.prompt.strip():
            _fail("prompt", self.prompt, "must be a non-empty string")
        if not isinstance(self.n, int) or isinstance(self.n, bool) or not 1 <= self.n <= MAX_GROUP_SIZE:
            _fail("n", self.n, f"must be an integer in [1, {MAX_GROUP_SIZE}] (images per prompt group)")
        for name in ("height", "width"):
            if problem := side_problem(getattr(self, name)):
                _fail(name, getattr(self, name), problem)
        if self.num_frames is not None and (not isinstance(self.num_frames, int) or isinstance(self.num_frames, bool)
                                            or not 1 <= self.num_frames <= MAX_FRAMES):
            _fail("num_frames", self.num_frames, f"must be an integer in [1, {MAX_FRAMES}] (frames of each video) or "
                  "None (images)")
        steps = self.num_inference_steps
        if not isinstance(steps, int) or isinstance(steps, bool) or steps < 2:
            _fail("num_inference_steps", steps, "must be an integer >= 2 (one step divides by zero in the schedule)")
        if not _is_real(self.guidance_scale) or self.guidance_scale < 1:
            _fail("guidance_scale", self.guidance_scale, "must be a number >= 1 (1 disables CFG)")
        if self.guidance_scale > 1 and self.negative_prompt is None:
            _fail("negative_prompt", None, "is required when guidance_scale > 1 (true CFG); ' ' is the usual choice")
        if self.embedded_guidance_scale is not None and (not _is_real(self.embedded_guidance_scale)
                                                         or self.embedded_guidance_scale < 0):
            _fail("embedded_guidance_scale", self.embedded_guidance_scale,
                  "must be a number >= 0 (a guidance-distilled model's guidance input) or None")
        if self.negative_prompt is not None and not isinstance(self.negative_prompt, str):
            _fail("negative_prompt", self.negative_prompt, "must be a string or None")
        if not _is_real(self.noise_level) or self.noise_level < 0:
            _fail("noise_level", self.noise_level, "must be a number >= 0")
        if self.sde_type not in SDE_TYPES:
            _fail("sde_type", self.sde_type, f"must be one of {SDE_TYPES}")
        if window_problem := _window_problem(self.sde_window, steps):
            _fail("sde_window", self.sde_window, window_problem)
        if isinstance(self.sde_window, list):  # from JSON or a config: one form everywhere
            object.__setattr__(self, "sde_window", tuple(self.sde_window))
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)
                                      or not 0 <= self.seed <= MAX_SEED):
            _fail("seed", self.seed, f"must be an integer in [0, {MAX_SEED}] or None")
        if not isinstance(self.sample_offset, int) or self.sample_offset < 0:
            _fail("sample_offset", self.sample_offset, "must be an integer >= 0")
        if self.group_id is not None and (not isinstance(self.group_id, int) or isinstance(self.group_id, bool)
                                          or self.group_id < 0):
            _fail("group_id", self.group_id, "must be an integer >= 0 or None")
        if self.lora_version is not None and (not isinstance(self.lora_version, int)
                                              or isinstance(self.lora_version, bool) or self.lora_version < 0):
            _fail("lora_version", self.lora_version, "must be an integer >= 0 (0: the base model) or None")
        if self.image is not None:
            image = self.image
            if (not isinstance(image, torch.Tensor) or image.dtype != torch.uint8 or image.ndim != 3
                    or image.shape[2] != 3):
                _fail("image", _describe(image), "must be a uint8 tensor [H, W, 3] (RGB)")
            if min(image.shape[:2]) < 16 or image.shape[0] * image.shape[1] > MAX_EDIT_PIXELS:
                _fail("image", _describe(image), "must be at least 16x16 and at most 4096x4096 pixels")
        if not _is_real(self.image_guidance_scale) or self.image_guidance_scale < 1:
            _fail("image_guidance_scale", self.image_guidance_scale, "must be a number >= 1 (1 disables image CFG)")
        lo_hi = self.cfg_interval
        if (not isinstance(lo_hi, (tuple, list)) or len(lo_hi) != 2 or not all(_is_real(v) for v in lo_hi)
                or not 0 <= lo_hi[0] < lo_hi[1] <= 1):
            _fail("cfg_interval", lo_hi, "must be (lo, hi) with 0 <= lo < hi <= 1: CFG applies where lo < σ <= hi")
        if self.cfg_renorm not in CFG_RENORMS:
            _fail("cfg_renorm", self.cfg_renorm, f"must be one of {CFG_RENORMS}")
        if not _is_real(self.cfg_renorm_min) or not 0 <= self.cfg_renorm_min <= 1:
            _fail("cfg_renorm_min", self.cfg_renorm_min, "must be a number in [0, 1]")
        if not _is_real(self.timestep_shift) or self.timestep_shift <= 0:
            _fail("timestep_shift", self.timestep_shift, "must be a number > 0")

    @property
    def do_cfg(self) -> bool:
        return self.guidance_scale > 1

    @property
    def is_edit(self) -> bool:
        return self.image is not None

    @property
    def is_video(self) -> bool:
        return self.num_frames is not None

    @property
    def step_noise_levels(self) -> list[float]:
        """η of each denoising step: `noise_level` inside the SDE window, 0 (the ODE step) outside it."""
        return noise_levels(self.noise_level, self.num_inference_steps, self.sde_window)

    def replace(self, **changes) -> GenerationRequest:
        return dataclasses.replace(self, **changes)


def _window_problem(window, num_steps: int) -> str | None:
    if window is None:
        return None
    if (not isinstance(window, (tuple, list)) or len(window) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in window)
            or not 0 <= window[0] < window[1] <= num_steps):
        return f"must be (first, last + 1) steps with 0 <= first < last + 1 <= num_inference_steps={num_steps}, or None"
    return None


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"tensor{list(value.shape)} {str(value.dtype).removeprefix('torch.')}"
    return type(value).__name__


def _is_real(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@dataclass
class Trajectory:
    """One prompt group as sampled. Tensors live on the CPU; L = packed latent tokens, C = packed channels."""

    prompt: str
    group_id: int | None
    images: torch.Tensor  # uint8 [n, H, W, 3]; a video family's frames: [n, F, H, W, 3]
    latents: torch.Tensor  # fp32 [n, T+1, L, C]: x at sigmas[0..T] (packed layout of the family)
    log_probs: torch.Tensor  # fp32 [n, T]: log-prob of each taken step under the rollout policy
    # fp32 [T]: the model's timestep input at each step (Qwen-Image: σ·1000 after shifting; BAGEL: σ itself)
    timesteps: torch.Tensor
    sigmas: torch.Tensor  # fp32 [T+1]: noise levels visited, sigmas[T] = 0
    noise_level: float
    sde_type: str
    seed: int
    lora_version: int
    height: int
    width: int
    family: str = "qwen_image"
    num_frames: int | None = None  # frames of each video (GenerationRequest's); None: images
    # the SDE window as sampled (GenerationRequest's): only its steps carry a density and are trained
    sde_window: tuple[int, int] | None = None
    guidance_scale: float = 1.0
    embedded_guidance_scale: float | None = None  # GenerationRequest's, as sampled
    # Qwen-Image: the text-encoder states the transformer saw (shared by the group), [S, D] and int64 [S]; the
    # negative prompt's when CFG is on
    prompt_embeds: torch.Tensor | None = None
    prompt_mask: torch.Tensor | None = None
    negative_prompt_embeds: torch.Tensor | None = None
    negative_prompt_mask: torch.Tensor | None = None
    # BAGEL: what the context is rebuilt from (app/models/bagel/context.py: token ids, an edit's encoded image)
    conditioning: dict[str, torch.Tensor] = field(default_factory=dict)
    # BAGEL's guidance settings as sampled (GenerationRequest's)
    image_guidance_scale: float = 1.0
    cfg_interval: tuple[float, float] = (0.0, 1.0)
    cfg_renorm: str = "global"
    cfg_renorm_min: float = 0.0
    sample_offset: int = 0
    # who produced it (engine kind, replica): staleness and load balancing are measured, not assumed
    producer: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        n, t1 = self.latents.shape[:2]
        steps = t1 - 1
        frames = () if self.num_frames is None else (self.num_frames,)
        pixels = (n, *frames, self.height, self.width, 3)
        checks = [
            (self.images.dtype == torch.uint8 and self.images.shape == pixels,
             f"images {tuple(self.images.shape)} {self.images.dtype} must be uint8 {list(pixels)}"),
            (self.log_probs.shape == (n, steps), f"log_probs {tuple(self.log_probs.shape)} must be [{n}, {steps}]"),
            (self.timesteps.shape == (steps,), f"timesteps {tuple(self.timesteps.shape)} must be [{steps}]"),
            (self.sigmas.shape == (t1,), f"sigmas {tuple(self.sigmas.shape)} must be [{t1}]"),
            (_window_problem(self.sde_window, steps) is None, f"sde_window {self.sde_window} must lie in [0, {steps}]"),
        ]
        # the conditioning travels in one of two forms (app/models/<family>: which one the family uses)
        checks.append((self.prompt_embeds is not None or bool(self.conditioning),
                       "a trajectory must carry its conditioning: prompt_embeds (text-encoder states) or conditioning "
                       "(what the denoiser builds its context from)"))
        if self.prompt_embeds is not None:
            checks += [
                (self.prompt_embeds.ndim == 2 and self.prompt_mask is not None
                 and self.prompt_mask.shape == self.prompt_embeds.shape[:1],
                 "prompt_embeds must be [S, D] with prompt_mask [S]"),
                ((self.negative_prompt_embeds is None) == (self.guidance_scale <= 1),
                 "negative_prompt_embeds must be present exactly when guidance_scale > 1"),
            ]
        if self.conditioning and self.prompt_embeds is None:  # the denoiser builds its context from token ids
            ids = self.conditioning.get("prompt_ids")
            checks.append((ids is not None and ids.ndim == 1 and not ids.is_floating_point(),
                           "conditioning without prompt_embeds must hold prompt_ids [S] (token ids)"))
        for ok, message in checks:
            if not ok:
                raise ValueError(f"inconsistent Trajectory: {message}")

    @classmethod
    def sampled(cls, request: GenerationRequest, *, seed: int, lora_version: int, images: torch.Tensor,
                latents: torch.Tensor, log_probs: torch.Tensor, timesteps: torch.Tensor, sigmas: torch.Tensor,
                family: str = "qwen_image", prompt_embeds: torch.Tensor | None = None,
                prompt_mask: torch.Tensor | None = None, negative_prompt_embeds: torch.Tensor | None = None,
                negative_prompt_mask: torch.Tensor | None = None, conditioning: dict[str, torch.Tensor] | None = None,
                producer: dict | None = None) -> Trajectory:
        """The record of `request` as an engine sampled it: what the request fixed is copied from it, the rest is
        what the engine produced (every engine builds its trajectories here)."""
        return cls(prompt=request.prompt, group_id=request.group_id, images=images, latents=latents,
                   log_probs=log_probs, timesteps=timesteps, sigmas=sigmas, family=family,
                   prompt_embeds=prompt_embeds, prompt_mask=prompt_mask, noise_level=request.noise_level,
                   sde_type=request.sde_type, sde_window=request.sde_window, seed=seed, lora_version=lora_version,
                   height=request.height, num_frames=request.num_frames,
                   width=request.width, guidance_scale=request.guidance_scale,
                   embedded_guidance_scale=request.embedded_guidance_scale,
                   negative_prompt_embeds=negative_prompt_embeds if request.do_cfg else None,
                   negative_prompt_mask=negative_prompt_mask if request.do_cfg else None,
                   conditioning=dict(conditioning or {}), image_guidance_scale=request.image_guidance_scale,
                   cfg_interval=tuple(request.cfg_interval), cfg_renorm=request.cfg_renorm,
                   cfg_renorm_min=request.cfg_renorm_min, sample_offset=request.sample_offset,
                   producer=dict(producer or {}))

    @property
    def group_size(self) -> int:
        return self.latents.shape[0]

    @property
    def is_video(self) -> bool:
        return self.num_frames is not None

    @property
    def nbytes(self) -> int:
        """The bytes of its tensors: what a group weighs on its way to the trainer."""
        return sum(t.nbytes for t in self.tensors().values())

    @property
    def num_inference_steps(self) -> int:
        return self.latents.shape[1] - 1

    @property
    def stochastic_steps(self) -> list[int]:
        """The steps sampled with noise: the only ones with a density, hence the only ones trained."""
        return stochastic_steps(self.num_inference_steps, self.sde_window)

    @property
    def step_noise_levels(self) -> list[float]:
        """η of each step as sampled (0 outside the SDE window): what re-scoring a step must use."""
        return noise_levels(self.noise_level, self.num_inference_steps, self.sde_window)

    @property
    def do_cfg(self) -> bool:
        return self.guidance_scale > 1

    def __reduce__(self):
        # on its way from a replica (Ray pickles with protocol 5), every tensor goes as a numpy array: an out-of-band
        # buffer, written once into the object store and read there in place by the trainer, where torch's own
        # pickling copies it into the pickle and out again (a video group's latents and frames are GBs)
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        fields["conditioning"] = {k: _as_array(v) for k, v in self.conditioning.items()}
        return _rebuilt_trajectory, ({k: _as_array(v) for k, v in fields.items()},)

    def tensors(self) -> dict[str, torch.Tensor]:
        """The tensor fields by name, `conditioning`'s as `conditioning.<name>` (for transport as safetensors)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
               if isinstance(getattr(self, f.name), torch.Tensor)}
        out.update({f"conditioning.{k}": v for k, v in self.conditioning.items()})
        return out


def _as_array(value):
    """A CPU tensor numpy can hold as that array (no copy); anything else as it is."""
    if isinstance(value, torch.Tensor) and value.device.type == "cpu" and value.dtype != torch.bfloat16:
        return value.detach().contiguous().numpy()
    return value


def _rebuilt_trajectory(fields: dict) -> Trajectory:
    import warnings

    import numpy as np

    def tensor(value):
        if not isinstance(value, np.ndarray):
            return value
        with warnings.catch_warnings():  # the object store's buffers are read-only, and a trajectory is never written
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            return torch.from_numpy(value)

    fields = {k: tensor(v) for k, v in fields.items()}
    fields["conditioning"] = {k: tensor(v) for k, v in fields["conditioning"].items()}
    return Trajectory(**fields)


@dataclass
class LoraAdapter:
    """A LoRA of the transformer, in memory: peft/diffusers tensor names (`<module>.lora_A.weight`, `.lora_B.`)."""

    tensors: dict[str, torch.Tensor]
    rank: int
    alpha: float
    target_modules: list[str]
    # 0 is the base model; each published adapter has a larger version
    version: int

    def __post_init__(self) -> None:
        if self.version < 1:
            raise ValueError(f"version={self.version}: adapter versions start at 1 (0 is the base model)")
        if self.rank < 1 or not self.target_modules:
            raise ValueError(f"rank={self.rank}, target_modules={self.target_modules}: need rank >= 1 and targets")
        bad = [k for k in self.tensors if ".lora_A." not in k and ".lora_B." not in k]
        if bad:
            raise ValueError(f"LoRA tensor names must contain .lora_A. or .lora_B.; got {bad[:3]}")

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def packed(self, dtype: torch.dtype | None = None) -> PackedLora:
        """The adapter as one contiguous buffer (in `dtype`, e.g. the replicas' compute dtype; None: as it is).
        Each tensor is cast while it is copied in: one pass over the adapter."""
        dtypes = {name: dtype or t.dtype for name, t in self.tensors.items()}
        offsets, total = {}, 0
        for name, tensor in self.tensors.items():  # each tensor starts 8-byte aligned: any dtype can view it
            offsets[name] = total
            total += -(-tensor.numel() * dtypes[name].itemsize // 8) * 8
        flat = torch.empty(total, dtype=torch.uint8)
        index = []
        for name, tensor in self.tensors.items():
            start, size = offsets[name], tensor.numel() * dtypes[name].itemsize
            flat[start:start + size].view(dtypes[name]).copy_(tensor.reshape(-1))
            index.append((name, str(dtypes[name]).removeprefix("torch."), tuple(tensor.shape), start))
        return PackedLora(flat.numpy(), index, rank=self.rank, alpha=self.alpha,
                          target_modules=list(self.target_modules), version=self.version)


@dataclass
class PackedLora:
    """A `LoraAdapter` as it travels through Ray's object store: one uint8 numpy buffer and an index of
    (name, dtype, shape, byte offset). Ray stores a numpy array without pickling and reads it back zero-copy on the
    same node, where a dict of torch tensors is pickled tensor by tensor; and one buffer is one host-to-device
    copy at the replica."""

    buffer: object  # numpy uint8 [bytes]
    index: list[tuple[str, str, tuple[int, ...], int]]
    rank: int
    alpha: float
    target_modules: list[str]
    version: int

    @property
    def nbytes(self) -> int:
        return int(self.buffer.nbytes)

    def unpack(self, device: str | torch.device = "cpu") -> LoraAdapter:
        """The adapter, its tensors views of one copy of the buffer on `device`. A GPU copy runs on a stream of its
        own: on the default stream it would wait behind the generation kernels queued there."""
        import warnings

        with warnings.catch_warnings():  # the object store's buffer is read-only; it is only read (copied) here
            warnings.simplefilter("ignore", UserWarning)
            data = torch.from_numpy(self.buffer)
        device = torch.device(device)
        if device.type == "cuda":
            stream = torch.cuda.Stream(device)
            with torch.cuda.stream(stream):
                data = data.pin_memory().to(device, non_blocking=True)
            stream.synchronize()
            data.record_stream(torch.cuda.default_stream(device))  # read there later: freed only after that
        elif device.type != "cpu":
            data = data.to(device)
        else:
            data = data.clone()
        tensors = {}
        for name, dtype_name, shape, offset in self.index:
            dtype = getattr(torch, dtype_name)
            tensors[name] = data[offset:offset + math.prod(shape) * dtype.itemsize].view(dtype).view(shape)
        return LoraAdapter(tensors, rank=self.rank, alpha=self.alpha, target_modules=list(self.target_modules),
                           version=self.version)
