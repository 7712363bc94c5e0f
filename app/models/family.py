"""The one face of a model family: what the rest of the code asks a family, and the registry keyed by
`model.family`.

A family is a folder of app/models/ (`qwen_image/`, `bagel/`) whose `__init__.py` defines `FAMILY`, an object
with the attributes and methods of `ModelFamily` below. Everything that differs between families lives behind it:
the denoiser and how a stored step is scored, the conditioning and its limits, LoRA targets, the checkpoint layout,
the tiny and real-size builders, the FLOPs of a forward, and how vllm-omni serves the family. The rest of the code
asks the family and never branches on its name. Adding a family: docs/model_families.md.

Importing this module or a family's `__init__` imports neither torch nor diffusers (a config is read without
them); the methods import what they need.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from app.algo.sde import SDEStepOutput
    from app.types import GenerationRequest, Trajectory

# the registered families, in the order the docs list them; a family's folder is app/models/<name>/
FAMILY_NAMES = ("qwen_image", "bagel", "sd3", "flux", "z_image", "wan")
VLLM_OMNI = "vllm_omni"  # the serving engine's name (every family runs on it)


@dataclass(frozen=True)
class VllmOmniRecipe:
    """How vllm-omni serves a family (app/rollout/vllm_omni/engine.py reads it)."""

    # our FlowGRPO pipeline subclass, by import path (vllm-omni imports it in its worker process); None: not built
    # yet (the config refuses rollout.engine=vllm_omni for the family, naming its other engines)
    pipeline_class: str | None
    # a deploy config shipped with vllm-omni (None: the engine's arguments alone)
    deploy_config: str | None = None
    # vllm-omni's deploy with a thinker stage before the DiT (`rollout.thinker_stage`; None: the family has none)
    thinker_deploy_config: str | None = None
    # a compute dtype vllm-omni hard-codes for the family (None: model.dtype)
    dtype: str | None = None
    # vllm-omni's num_inference_steps minus ours (BAGEL counts schedule points: T steps are T + 1 points)
    extra_schedule_points: int = 0
    # how a LoRA is served: "vllm_manager" (vllm's LoRA manager, selected by a LoRARequest) or "pipeline_hooks"
    # (the pipeline's own hooks, selected by the version in the request's FlowGRPO arguments)
    lora_delivery: str = "vllm_manager"
    # full transformer weight updates (`update_weights`)
    weight_updates: bool = True
    # LoRA module paths vllm-omni's DiT names differently from diffusers: (diffusers, vllm-omni) pairs
    lora_renames: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class Preset:
    """A checkpoint `jobs.make_tiny_models --preset NAME` builds: `builder` ("module:function") is called as
    `function(out, seed=..., overwrite=...)`, plus `<layers_arg>=layers` (or `default_layers`) when it takes one."""

    builder: str
    description: str
    layers_arg: str | None = None
    default_layers: int | None = None
    layers_help: str | None = None  # what --layers means for it

    def build(self, out: str | Path, *, seed: int = 0, layers: int | None = None, overwrite: bool = False) -> Path:
        module, _, name = self.builder.partition(":")
        kwargs = {self.layers_arg: layers or self.default_layers} if self.layers_arg else {}
        return getattr(importlib.import_module(module), name)(out, seed=seed, overwrite=overwrite, **kwargs)


@dataclass(frozen=True)
class FamilyBase:
    """What a family declares, and what follows from it alone. A family is a subclass of this that adds the
    methods of `ModelFamily`, instantiated once as its folder's `FAMILY`."""

    name: str
    # the rollout engines that serve it: name -> engine class by import path (`rollout.engine` picks one)
    engines: dict[str, str]
    # the engines whose log-probs equal the trainer's exactly (the others need train.old_logprob=recompute)
    exact_engines: tuple[str, ...]
    # peft target modules of the trained denoiser when the config names none
    lora_targets: tuple[str, ...]
    # what `save_adapter` writes, as the run's summary tells the user
    adapter_format: str
    # the denoiser's top-level modules a LoRA of the family lives in (how an adapter file tells its family)
    adapter_roots: tuple[str, ...]
    # files that identify a checkpoint folder of the family, and what such a folder is
    checkpoint_files: tuple[str, ...]
    checkpoint_layout: str
    # edits (a request with an input image)
    supports_edits: bool
    # generates videos: every request carries `num_frames` (an image family's requests carry none)
    video: bool
    vllm_omni: VllmOmniRecipe
    # the checkpoints jobs.make_tiny_models builds, and which of them is the tiny one (tests, the CPU demo)
    presets: dict[str, Preset]
    tiny_preset: str
    # an engine's denoiser may replay its compiled blocks as CUDA graphs (model.compile.mode: reduce-overhead):
    # nothing a block returns is kept past the forward, whose next replay overwrites it
    cuda_graphs: bool
    # guidance-distilled (FLUX.1-dev): the guidance scale is an input of the denoiser's one forward a step
    # (`rollout.embedded_guidance_scale`, required), not a CFG branch
    embedded_guidance: bool

    def checkpoint_problem(self, path: str | Path) -> str | None:
        """None when `path` looks like a checkpoint of the family, else what is missing."""
        missing = [name for name in self.checkpoint_files if not (Path(path) / name).is_file()]
        return f"is not {self.checkpoint_layout} (missing {', '.join(missing)})" if missing else None

    def frames_problem(self, num_frames: int) -> str | None:
        """Why a video family cannot sample videos of `num_frames` frames (its VAE's rule), or None."""
        return None

    def request_problem(self, request: GenerationRequest) -> tuple[str, str] | None:
        """(field, why) of what in `request` the family cannot sample whatever its checkpoint (frames for an image
        family, none or the wrong count for a video family), or None."""
        if self.video and request.num_frames is None:
            return "num_frames", f"is required: model.family={self.name} generates videos (e.g. 33 or 81 frames)"
        if not self.video and request.num_frames is not None:
            return "num_frames", f"model.family={self.name} generates images: leave num_frames out"
        if self.video and (why := self.frames_problem(request.num_frames)) is not None:
            return "num_frames", why
        return None

    def build_tiny(self, path: str | Path, seed: int = 0) -> Path:
        """The deterministic tiny random checkpoint at `path` (kept when an identical build is there)."""
        return self.presets[self.tiny_preset].build(path, seed=seed)

    def prepare_compile(self, settings) -> None:
        """What the family changes in this process before its blocks compile (`model.compile` settings)."""

    def engine_class(self, engine: str) -> type:
        """The rollout engine class `engine` names for this family."""
        if engine not in self.engines:
            raise ValueError(f"rollout.engine={engine} cannot run model.family={self.name}: use one of "
                             f"{list(self.engines)}")
        module, _, name = self.engines[engine].rpartition(".")
        return getattr(importlib.import_module(module), name)


@dataclass(frozen=True)
class DiffusersFamily(FamilyBase):
    """A family whose denoiser is a diffusers transformer in the `transformer/` folder of a diffusers pipeline
    checkpoint, with its repeated blocks in `transformer_blocks` (Qwen-Image, SD3). Its folder's `model.py` has
    `score_trajectory(transformer, traj, steps, samples=..., flow_grpo_compat=...)` and `flops.py`
    `trajectory_forward_flops(config, traj)`; a subclass adds `prompt_checker` and `vllm_omni_guidance`."""

    transformer_class: str  # diffusers' class names, e.g. "SD3Transformer2DModel", "StableDiffusion3Pipeline"
    pipeline_class: str

    def _diffusers(self, name: str):
        return getattr(importlib.import_module("diffusers"), name)

    def _part(self, module: str):
        return importlib.import_module(f"app.models.{self.name}.{module}")

    def load_denoiser(self, path, *, dtype, device):
        from app.models.precision import exact_fp32

        exact_fp32(dtype)
        # on a GPU the weights go straight there (a 20B model never sits in the host's memory)
        placement = {"device_map": {"": device}} if device.type == "cuda" else {}
        return self._diffusers(self.transformer_class).from_pretrained(Path(path) / "transformer", dtype=dtype,
                                                                        **placement)

    def denoiser_config(self, path):
        return self._diffusers(self.transformer_class).load_config(Path(path) / "transformer")

    def denoiser_skeleton(self, path):
        import torch

        cls = self._diffusers(self.transformer_class)
        with torch.device("meta"):
            return cls.from_config(cls.load_config(Path(path) / "transformer"))

    def shard_units(self, denoiser):
        return list(denoiser.transformer_blocks), True

    def compiled_blocks(self, denoiser):
        return list(denoiser.transformer_blocks)

    def score_trajectory(self, denoiser, traj, steps, samples, *, flow_grpo_compat=False, uniform=False):
        return self._part("model").score_trajectory(denoiser, traj, steps, samples=samples,
                                                    flow_grpo_compat=flow_grpo_compat)

    def forward_flops(self, config, traj):
        return self._part("flops").trajectory_forward_flops(config, traj)

    def shaped_trajectory(self, path, request, config, generator):
        """A group shaped as the rollout returns it for `request`, random values: what `jobs.bench_train_step`
        trains on (the cost does not depend on the values). `config`: the denoiser's (`denoiser_config`)."""
        return self._part("model").shaped_trajectory(path, request, config, generator)

    def save_adapter(self, directory, tensors, *, rank, alpha, target_modules) -> Path:
        """As diffusers writes LoRAs: the pipeline's `load_lora_weights(directory)` loads it."""
        self._diffusers(self.pipeline_class).save_lora_weights(
            directory, transformer_lora_layers=tensors,
            transformer_lora_adapter_metadata={"r": rank, "lora_alpha": alpha,
                                               "target_modules": sorted(target_modules)})
        return Path(directory) / "pytorch_lora_weights.safetensors"


class ModelFamily(Protocol):
    """The face: a `FamilyBase` (the declared facts above) with these methods."""

    name: str
    vllm_omni: VllmOmniRecipe

    def load_denoiser(self, path: str | Path, *, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
        """The trained module (frozen weights, no adapter yet), from a checkpoint folder."""

    def denoiser_config(self, path: str | Path) -> Any:
        """The denoiser's config (what `forward_flops` reads) from a checkpoint folder, without loading weights."""

    def denoiser_skeleton(self, path: str | Path) -> torch.nn.Module:
        """The trained module's layers on the meta device, nothing read but the config: the shapes an adapter is
        made from where the weights live in another process (vllm-omni's)."""

    def shard_units(self, denoiser: torch.nn.Module) -> tuple[list[torch.nn.Module], bool]:
        """(FSDP2 units, whether the root is sharded too)."""

    def compiled_blocks(self, denoiser: torch.nn.Module) -> list[torch.nn.Module]:
        """The repeated blocks `torch.compile` compiles one by one (app/models/compile.py): the blocks that do
        the work, each a graph without data-dependent control flow."""

    def prepare_compile(self, settings: Any) -> None:
        """Set up this process for compiling the family's blocks with a `model.compile` section (Qwen-Image: the
        rotary embedding in real arithmetic when `real_rope`)."""

    def score_trajectory(self, denoiser: torch.nn.Module, traj: Trajectory, steps: Sequence[int],
                         samples: Sequence[int], *, flow_grpo_compat: bool, uniform: bool) -> list[SDEStepOutput]:
        """Re-score a trajectory's stored steps under `denoiser` as it stands (`app.algo.sampling.score_steps`).
        uniform: every rank makes the same forwards whatever the group (FSDP2)."""

    def forward_flops(self, config: Any, traj: Trajectory) -> tuple[float, int]:
        """(matmul FLOPs of one denoiser forward of one image, forwards per denoising step) for a trajectory of
        the family, from the denoiser's config."""

    def prompt_checker(self, path: str | Path) -> Callable[[GenerationRequest], tuple[str, str] | None]:
        """A check of a request's texts against the family's text limit, with what it needs loaded from the
        checkpoint (its tokenizer): (field, why) of the first text over it, or None."""

    def save_adapter(self, directory: str | Path, tensors: dict[str, torch.Tensor], *, rank: int, alpha: float,
                     target_modules: Sequence[str]) -> Path:
        """The adapter as the family's tools load it; the weights file written."""

    def vllm_omni_guidance(self, request: GenerationRequest) -> tuple[dict, dict]:
        """(sampling-parameter fields, extra_args entries) that carry the request's guidance to the pipeline."""


def prompt_fields_checker(problem: Callable[[str], str | None]):
    """The check of a request's prompt and (under CFG) negative prompt by `problem(text)` (why a text is over the
    family's limit, or None)."""

    def check(request: GenerationRequest) -> tuple[str, str] | None:
        texts = [("prompt", request.prompt)]
        if request.do_cfg and request.negative_prompt:
            texts.append(("negative_prompt", request.negative_prompt))
        for field_name, text in texts:
            if (why := problem(text)) is not None:
                return field_name, why
        return None

    return check


def t5_prompt_checker(tokenizer_dir: str | Path, limit: int, model: str):
    """The check of a family whose prompt reaches its transformer through T5 padded to `limit` tokens (SD3, FLUX):
    beyond them T5 would drop the rest silently (CLIP's 77 tokens cut longer prompts in every such pipeline; T5
    carries the whole prompt)."""
    from transformers import T5Tokenizer

    tokenizer = T5Tokenizer.from_pretrained(tokenizer_dir)

    def problem(text: str) -> str | None:
        tokens = len(tokenizer(text).input_ids)
        if tokens <= limit:
            return None
        return f"is {tokens} T5 tokens; the limit is {limit}, {model}'s T5 length: shorten it"

    return prompt_fields_checker(problem)


def get_family(name: str) -> ModelFamily:
    """The family registered as `name` (its folder's `FAMILY`)."""
    if str(name) not in FAMILY_NAMES:
        raise ValueError(f"model.family={name!r} is not one of {list(FAMILY_NAMES)}")
    return importlib.import_module(f"app.models.{name}").FAMILY


def all_engines() -> tuple[str, ...]:
    """Every engine name some family runs on (the config's choices), serving engine first."""
    names = [VLLM_OMNI]
    for family in FAMILY_NAMES:
        names += [e for e in get_family(family).engines if e not in names]
    return tuple(names)
