"""How an adapter reaches a vllm-omni pipeline (`LORA_DELIVERIES`, by the family's `VllmOmniRecipe.lora_delivery`).

`to_vllm_omni`: peft/diffusers LoRA names → vllm-omni's Qwen-Image DiT names, for vllm's LoRA manager. The only
module that differs is the attention output projection: diffusers `attn.to_out.0`, vllm-omni
`attn.to_out` (its loader applies the same rename to full weights). Fused projections (to_q/k/v → to_qkv,
add_q/k/v_proj → add_kv_proj) keep their per-projection LoRA names: vllm's LoRA model packs them itself.
"""

from __future__ import annotations

from app.models.lora import PEFT_PREFIX, transformer_key
from app.types import LoraAdapter


def _module_name(name: str) -> str:
    return name.replace(".to_out.0.", ".to_out.")


def _target_name(target: str) -> str:
    return target.removesuffix(".0") if target == "to_out.0" or target.endswith(".to_out.0") else target


def to_vllm_omni(adapter: LoraAdapter) -> tuple[dict, dict]:
    """(tensors, peft_config) in the form vllm's `LoRAModel.from_lora_tensors` / `PEFTHelper.from_dict` take."""
    tensors = {}
    for key, value in adapter.tensors.items():
        tensors[PEFT_PREFIX + _module_name(transformer_key(key))] = value.detach().contiguous()
    config = {"r": adapter.rank, "lora_alpha": adapter.alpha,
              "target_modules": sorted({_target_name(t) for t in adapter.target_modules})}
    return tensors, config


def to_pipeline_hooks(adapter: LoraAdapter) -> tuple[dict, dict]:
    """(tensors, peft_config) for a pipeline that applies the adapter with its own hooks (BAGEL's generation expert,
    bagel_lora.py): the trainer's names, checked here so that an adapter it cannot serve is refused when published."""
    from app.rollout.vllm_omni.bagel_lora import split_adapter

    split_adapter(adapter)
    tensors = {transformer_key(k): v.detach().contiguous() for k, v in adapter.tensors.items()}
    return tensors, {"r": adapter.rank, "lora_alpha": adapter.alpha, "target_modules": list(adapter.target_modules)}


# how a family's adapter reaches its pipeline (`VllmOmniRecipe.lora_delivery`) → its staged form
LORA_DELIVERIES = {"vllm_manager": to_vllm_omni, "pipeline_hooks": to_pipeline_hooks}
