"""How an adapter reaches a vllm-omni pipeline (`LORA_DELIVERIES`, by the family's `VllmOmniRecipe.lora_delivery`).

`to_vllm_omni`: peft/diffusers LoRA names → the names of vllm-omni's DiT, for vllm's LoRA manager. Modules vllm-omni
names differently are renamed as the family's recipe says (`VllmOmniRecipe.lora_renames`; Qwen-Image's attention
output projection: diffusers `attn.to_out.0`, vllm-omni `attn.to_out`, the rename its loader applies to full
weights). Fused projections (to_q/k/v → to_qkv, add_q/k/v_proj → add_kv_proj) keep their per-projection LoRA names:
vllm's LoRA model packs them itself. `StagedLoraPipeline` is the pipelines' side: the staged tensors, loaded by
vllm's LoRA manager without a file.
"""

from __future__ import annotations

from pathlib import Path

import torch

from app.models.lora import PEFT_PREFIX, transformer_key
from app.types import LoraAdapter


def _rename(name: str, renames) -> str:
    """`name` (a module, a tensor's or a target's) with each (old, new) module path replaced, whole components only."""
    for old, new in renames:
        name = f".{name}.".replace(f".{old}.", f".{new}.")[1:-1]
    return name


def to_vllm_omni(adapter: LoraAdapter, recipe) -> tuple[dict, dict]:
    """(tensors, peft_config) in the form vllm's `LoRAModel.from_lora_tensors` / `PEFTHelper.from_dict` take."""
    renames = recipe.lora_renames
    tensors = {}
    for key, value in adapter.tensors.items():
        tensors[PEFT_PREFIX + _rename(transformer_key(key), renames)] = value.detach().contiguous()
    config = {"r": adapter.rank, "lora_alpha": adapter.alpha,
              "target_modules": sorted({_rename(t, renames) for t in adapter.target_modules})}
    return tensors, config


def to_pipeline_hooks(adapter: LoraAdapter, recipe) -> tuple[dict, dict]:
    """(tensors, peft_config) for a pipeline that applies the adapter with its own hooks (BAGEL's generation expert,
    bagel_lora.py): the trainer's names, checked here so that an adapter it cannot serve is refused when published."""
    from app.rollout.vllm_omni.bagel_lora import split_adapter

    split_adapter(adapter)
    tensors = {transformer_key(k): v.detach().contiguous() for k, v in adapter.tensors.items()}
    return tensors, {"r": adapter.rank, "lora_alpha": adapter.alpha, "target_modules": list(adapter.target_modules)}


# the id under which a compiled engine stages its zero adapter, served for version 0 (the base model): far above
# any published version, and never evicted by newer ones (worker.py `stage_lora`)
BASE_LORA_ID = 2**31 - 1


def zero_lora(checkpoint, *, rank: int, alpha: float, target_modules, dtype: torch.dtype) -> LoraAdapter | None:
    """An adapter whose every B is zero (the base model's outputs, through vLLM's LoRA layers) on the layers of
    `checkpoint` (a diffusers pipeline folder) that a LoRA on `target_modules` adapts: the layers, their shapes and
    the rank of every adapter the run will publish (None: the checkpoint has no such layer).

    A compiled engine serves version 0 with it. vLLM installs its LoRA layers in the transformer at the first
    adapter it serves: served the base model without one, the blocks compiled at step 1 are guarded on the plain
    layers (`___check_type_id(self._modules['attention']._modules['to_out']._modules['0'], ...)`,
    `RowParallelLinear`), and the first adapter published compiled every block again at step 2."""
    from app.rollout.vllm_omni.merge import checkpoint_layers, checkpoint_shapes

    folder = Path(checkpoint) / "transformer"
    layers = checkpoint_layers(folder, list(target_modules))
    shapes = checkpoint_shapes(folder, [f"{n}.weight" for n in layers])
    tensors = {}
    for name in layers:
        shape = shapes[f"{name}.weight"]
        if len(shape) != 2:  # peft adapts linear layers
            continue
        tensors[f"{name}.lora_A.weight"] = torch.zeros(rank, shape[1], dtype=dtype)
        tensors[f"{name}.lora_B.weight"] = torch.zeros(shape[0], rank, dtype=dtype)
    if not tensors:
        return None
    return LoraAdapter(tensors, rank=rank, alpha=alpha, target_modules=sorted(target_modules), version=BASE_LORA_ID)


# how a family's adapter reaches its pipeline (`VllmOmniRecipe.lora_delivery`) → its staged form
LORA_DELIVERIES = {"vllm_manager": to_vllm_omni, "pipeline_hooks": to_pipeline_hooks}


class StagedLoraPipeline:
    """A FlowGRPO pipeline's hook for vllm's LoRA manager: LoRA tensors staged in memory by the worker extension
    (worker.py `stage_lora`). vllm-omni's manager asks this hook first and reads a PEFT folder from
    `lora_request.lora_path` only when it returns None."""

    def _load_diffusion_lora_adapter(self, *, lora_request, lora_path, dtype):
        staged = getattr(self, "_staged_loras", {}).get(lora_request.lora_int_id)
        if staged is None:
            return None
        from vllm.lora.lora_model import LoRAModel
        from vllm.lora.peft_helper import PEFTHelper

        tensors, peft_config = staged
        helper = PEFTHelper.from_dict(dict(peft_config))
        # copies: the manager folds alpha / r into each B in place (`LoRALayerWeights.optimize`), and `.to()` to the
        # dtype and device they have already returns the staged tensor itself, which shares its memory with the
        # caller's (the engine's process): it came back scaled, and a second load would scale it again
        tensors = {name: tensor.clone() for name, tensor in tensors.items()}
        model = LoRAModel.from_lora_tensors(lora_model_id=lora_request.lora_int_id, tensors=tensors,
                                            peft_helper=helper, device="cpu", dtype=dtype)
        return model, helper
