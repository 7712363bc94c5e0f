"""The trained policy: the model family's denoiser (`ModelFamily.load_denoiser`: the diffusers Qwen-Image
transformer, BAGEL's Mixture-of-Transformers LLM, ...), frozen, with a peft LoRA, sharded with FSDP2.

- Per-step log-probs and means come from the family's `score` (app/models/family.py), i.e. from
  `app.algo.sampling.score_steps`, the loop the rollout engines sample with: the trainer scores exactly the
  transitions the rollout took. A family whose conditioning depends on the adapter (a BAGEL edit's image block)
  rebuilds it under the policy as it stands.
- The reference policy is the same module with the adapter disabled (`with policy.reference():`), so the KL costs
  one extra forward and no second copy of the weights.
- Under FSDP2 (`fully_shard` per transformer block, then the root) every rank holds a shard of every parameter;
  `export_adapter` gathers only the LoRA parameters (`app.train.gather`: one all-gather), never the 20B base model.
  Every FSDP2 forward and gather is a collective: all ranks must make the same calls in the same order.

No Ray and no config objects here: numbers and paths in, tensors out.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist

from app.algo.sde import SDEStepOutput
from app.models.attention import check_backward_in_background, trainer_kernels, use_sdpa_kernels
from app.models.family import ModelFamily, get_family
from app.models.lora import ADAPTER_NAME, transformer_key
from app.train.gather import to_host
from app.types import LoraAdapter, Trajectory


class Policy:
    def __init__(self, transformer, *, sharded: bool, family: ModelFamily):
        self.transformer = transformer  # the trained module of the family (BAGEL: `BagelMoT`)
        self.sharded = sharded
        self.family = family
        self.compiled = False  # its blocks run through torch.compile (`compile`)

    @classmethod
    def from_pretrained(
        cls,
        model_path: str | Path,
        *,
        lora_rank: int,
        lora_alpha: float,
        target_modules: Sequence[str],
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        seed: int = 0,
        adapter_tensors: dict[str, torch.Tensor] | None = None,
        shard: bool | None = None,
        gradient_checkpointing: bool = False,
        family: str = "qwen_image",
        compile=None,
        activation_memory_budget: float | None = None,
        shard_frozen: bool | None = None,
        reshard_after_forward: bool = True,
        attention_kernels: Sequence[str] | None = None,
    ) -> Policy:
        """Load the family's denoiser (`ModelFamily.load_denoiser`), freeze it, add the LoRA (initialised from
        `seed`, or loaded from `adapter_tensors` when resuming), then shard it when a process group is up
        (`shard=None`: auto). `gradient_checkpointing` recomputes each block's activations in the backward pass
        (real sizes need it). compile: a `model.compile` section; when enabled, each block the family names is
        compiled after FSDP2 wraps it. activation_memory_budget: the share of activations compile's partitioner
        keeps for the backward (`train.activation_memory_budget`; None: torch's default). shard_frozen: FSDP2 manages
        the frozen base weights too (None: only with several ranks; `_fully_shard`). reshard_after_forward: FSDP2's,
        for every unit (`train.reshard_after_forward`). attention_kernels: the kernels torch's attention may choose
        among in this process (`model.attention_kernels`; None: torch's less cuDNN's on a GPU, `trainer_kernels`),
        less cuDNN's where it is listed and its backward is wrong on this GPU (`check_backward_in_background`,
        measured while the model loads)."""
        device = torch.device(device)
        use_sdpa_kernels(trainer_kernels(attention_kernels, device))
        backward_checked = check_backward_in_background(device)  # beside the load: its seconds cost nothing
        transformer = get_family(family).load_denoiser(model_path, dtype=dtype, device=device)
        policy = cls.with_lora(transformer, lora_rank=lora_rank, lora_alpha=lora_alpha,
                               target_modules=target_modules, seed=seed, adapter_tensors=adapter_tensors,
                               gradient_checkpointing=gradient_checkpointing, family=family)
        transformer.to(device)
        policy.sharded = dist.is_available() and dist.is_initialized() if shard is None else shard
        if policy.sharded:
            _fully_shard(transformer, policy.family, dtype, shard_frozen=shard_frozen,
                         reshard_after_forward=reshard_after_forward)
        if (problem := backward_checked()) is not None:  # before the blocks compile: the kernels are traced in
            logging.getLogger(__name__).warning("the trainer leaves cuDNN's attention kernel out: %s", problem)
        policy.compile(compile, activation_memory_budget=activation_memory_budget)
        return policy

    def compile(self, settings, activation_memory_budget: float | None = None) -> None:
        """Compile the family's blocks as a `model.compile` section says (nothing when it is off)."""
        from app.models.compile import apply_compile

        self.compiled = apply_compile(self.transformer, self.family, settings,
                                      activation_memory_budget=activation_memory_budget) > 0 or self.compiled

    @classmethod
    def with_lora(cls, transformer, *, lora_rank: int, lora_alpha: float, target_modules: Sequence[str], seed: int = 0,
                  adapter_tensors: dict[str, torch.Tensor] | None = None,
                  gradient_checkpointing: bool = False, family: str = "qwen_image") -> Policy:
        """`transformer` frozen, with the LoRA added (fp32 weights: the optimizer updates those), unsharded. The
        single-process baseline samples with the same module it trains."""
        from peft import LoraConfig, set_peft_model_state_dict

        transformer.requires_grad_(False)
        if gradient_checkpointing:
            transformer.enable_gradient_checkpointing()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)  # every rank initialises the same adapter (A random, B = 0: starts at the base)
            transformer.add_adapter(LoraConfig(r=lora_rank, lora_alpha=lora_alpha,
                                               target_modules=list(target_modules)), ADAPTER_NAME)
        if adapter_tensors is not None:
            result = set_peft_model_state_dict(transformer, adapter_tensors, adapter_name=ADAPTER_NAME)
            if result.unexpected_keys:
                raise ValueError(f"checkpoint adapter does not match the model: {result.unexpected_keys[:3]}")
        for p in transformer.parameters():  # the optimizer updates fp32 LoRA weights; FSDP2 casts them for compute
            if p.requires_grad:
                p.data = p.data.float()
        return cls(transformer, sharded=False, family=get_family(family))

    def parameters(self) -> list[torch.nn.Parameter]:
        """The trainable (LoRA) parameters."""
        return [p for p in self.transformer.parameters() if p.requires_grad]

    def score(self, traj: Trajectory, steps: Sequence[int], samples: Sequence[int], *,
              flow_grpo_compat: bool = False) -> list[SDEStepOutput]:
        """log π(x_{i+1} | x_i) and the transition mean for each step i of `steps`, for group members `samples`
        (differentiable w.r.t. the LoRA unless called under `torch.no_grad()`)."""
        if traj.family != self.family.name:
            raise ValueError(f"a {traj.family} trajectory cannot be scored by a {self.family.name} policy")
        return self.family.score_trajectory(self.transformer, traj, steps, samples,
                                            flow_grpo_compat=flow_grpo_compat, uniform=self.sharded)

    @contextmanager
    def reference(self) -> Iterator[None]:
        """The reference policy π_ref: the base transformer, adapter switched off for the duration."""
        self.transformer.disable_adapters()
        try:
            yield
        finally:
            self.transformer.enable_adapters()

    def adapter_state(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """Full LoRA tensors in peft/diffusers naming (`<module>.lora_A.weight`), detached CPU copies (in `dtype` if
        given: cast on the device, before the copy). Gathers only the adapter parameters; under FSDP2 every rank
        must call it."""
        from peft import get_peft_model_state_dict

        params = [(name, p) for name, p in self.transformer.named_parameters() if f".{ADAPTER_NAME}." in name]
        return get_peft_model_state_dict(self.transformer, state_dict=to_host(params, dtype),
                                         adapter_name=ADAPTER_NAME)

    def export_adapter(self, version: int, dtype: torch.dtype | None = None) -> LoraAdapter:
        """The adapter as the replicas load it (`dtype`: what it travels in, e.g. their compute dtype)."""
        config = self.transformer.peft_config[ADAPTER_NAME]
        return LoraAdapter(self.adapter_state(dtype), rank=config.r, alpha=config.lora_alpha,
                           target_modules=sorted(config.target_modules), version=version)

    def save_adapter(self, directory: str | Path, tensors: dict[str, torch.Tensor] | None = None) -> Path:
        """The adapter as its family's tools load it (`ModelFamily.save_adapter`); the weights file written."""
        config = self.transformer.peft_config[ADAPTER_NAME]
        return self.family.save_adapter(directory, self.adapter_state() if tensors is None else tensors,
                                        rank=config.r, alpha=config.lora_alpha, target_modules=config.target_modules)


PEFT_WEIGHTS = "adapter_model.safetensors"  # a peft adapter folder's weights (the other form: diffusers' LoRA file)


def load_adapter_tensors(directory: str | Path) -> dict[str, torch.Tensor]:
    """Adapter tensors (peft naming, no `transformer.` prefix) of a folder written by `Policy.save_adapter`."""
    if (Path(directory) / PEFT_WEIGHTS).is_file():
        from safetensors.torch import load_file

        return load_file(str(Path(directory) / PEFT_WEIGHTS))
    from diffusers import QwenImagePipeline

    state = QwenImagePipeline.lora_state_dict(str(directory))
    return {transformer_key(k): v for k, v in state.items()}


def _fully_shard(transformer, family: ModelFamily, dtype: torch.dtype, *, shard_frozen: bool | None = None,
                 reshard_after_forward: bool = True) -> None:
    """FSDP2: one unit per block the family names (all-gathered only while it runs), then the root if it says so.
    shard_frozen: whether FSDP2 manages the frozen base weights too (None: only with several ranks). A rank that
    holds the whole model keeps them as they are: FSDP2 would copy every one of them into an unsharded buffer at
    every forward and backward (a world of one all-gathers nothing, yet still copies), where the LoRA it manages
    alone computes the same numbers (tests/train/test_policy.py). reshard_after_forward=False keeps each unit's
    gathered weights from its forward to its backward: one all-gather less per unit and pass, at the memory of the
    whole unsharded model while the pass runs."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    # fp32 LoRA next to a bf16 base: all-gather and compute in the model dtype, reduce gradients in fp32
    mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32) if dtype != torch.float32 else None
    kwargs = {"reshard_after_forward": reshard_after_forward, **({"mp_policy": mp} if mp is not None else {})}
    if shard_frozen is None:
        shard_frozen = dist.get_world_size() > 1
    if not shard_frozen:
        kwargs["ignored_params"] = {p for p in transformer.parameters() if not p.requires_grad}
    units, shard_root = family.shard_units(transformer)
    for unit in units:
        fully_shard(unit, **kwargs)
    if shard_root:
        fully_shard(transformer, **kwargs)
    # a unit may return views (BAGEL's layers: their keys and values, transposed), which nothing modifies in place
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
