"""A peft LoRA of BAGEL's generation expert, served inside vllm-omni's BAGEL pipeline by forward hooks.

vllm-omni's LoRA manager cannot bind BAGEL's generation-expert attention (its `q/k/v/o_proj_moe_gen` weights live
inside the MoT layers as `qkv_proj.gen_exp` / `o_proj.gen_exp`, not as modules), so
the adapter is applied here instead: a hook on each MoT projection adds scale · (x Aᵀ) Bᵀ to the rows of the image
tokens (the rows the generation expert computes), and nothing while no adapter is active, so switching back to the
base model restores its outputs exactly.

The adapter arrives as the trainer exported it (peft names of `BagelMoT`, app/models/bagel/model.py, whose module
names are upstream BAGEL's): `language_model.model.layers.N.<target>.lora_{A,B}.weight` for the 7 targets of
`GENERATION_TARGETS` (app/models/bagel/__init__.py). vllm-omni fuses some of them; each fused output is the
concatenation of its parts:

    self_attn.qkv_proj (gen rows)     q_proj_moe_gen | k_proj_moe_gen | v_proj_moe_gen
    self_attn.o_proj (gen rows)       o_proj_moe_gen
    mlp_moe_gen.gate_up_proj          mlp_moe_gen.gate_proj | mlp_moe_gen.up_proj
    mlp_moe_gen.down_proj             mlp_moe_gen.down_proj
"""

from __future__ import annotations

import re

import torch

from app.models.lora import transformer_key
from app.types import LoraAdapter

LAYER_PREFIX = "language_model.model.layers."
# vllm-omni module (relative to a decoder layer) → the peft targets its output concatenates, in order
FUSED_PARTS = {
    "self_attn.qkv_proj": ("self_attn.q_proj_moe_gen", "self_attn.k_proj_moe_gen", "self_attn.v_proj_moe_gen"),
    "self_attn.o_proj": ("self_attn.o_proj_moe_gen",),
    "mlp_moe_gen.gate_up_proj": ("mlp_moe_gen.gate_proj", "mlp_moe_gen.up_proj"),
    "mlp_moe_gen.down_proj": ("mlp_moe_gen.down_proj",),
}
SERVED_TARGETS = frozenset(part for parts in FUSED_PARTS.values() for part in parts)
# MoT projections are called as (x, text_indices, image_indices) in the generation mode, and as (x) in the
# understanding mode (no image rows then); the generation expert's MLP sees only image rows, as (x)
_MOT_PROJECTIONS = ("self_attn.qkv_proj", "self_attn.o_proj")
_KEY = re.compile(r"^language_model\.model\.layers\.(\d+)\.(.+)\.lora_([AB])\.weight$")


def split_adapter(adapter: LoraAdapter) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """(layer, peft target) → (A [r, in], B [out, r]); a clear error for a tensor this path cannot serve."""
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in adapter.tensors.items():
        match = _KEY.match(transformer_key(key))
        if match is None or match.group(2) not in SERVED_TARGETS:
            raise ValueError(f"LoRA tensor {key!r}: vllm-omni's BAGEL pipeline serves a LoRA only on the generation "
                             f"expert's projections {sorted(SERVED_TARGETS)} (model.lora_target_modules)")
        pairs.setdefault((int(match.group(1)), match.group(2)), {})[match.group(3)] = tensor
    missing = [k for k, v in pairs.items() if set(v) != {"A", "B"}]
    if missing:
        raise ValueError(f"LoRA tensors without their A or B half: {missing[:3]}")
    return {k: (v["A"], v["B"]) for k, v in pairs.items()}


class GenerationExpertLora:
    """Hooks on every decoder layer of a vllm-omni `Qwen2MoTModel`; `activate` installs an adapter's weights."""

    def __init__(self, layers: torch.nn.ModuleList):
        self.layers = layers
        self.version = 0
        self._weights: dict[tuple[int, str], list[tuple[torch.Tensor, torch.Tensor] | None]] = {}
        self._scaling = 0.0
        for index, layer in enumerate(layers):
            for name in FUSED_PARTS:
                layer.get_submodule(name).register_forward_hook(self._hook(index, name))

    def activate(self, adapter: LoraAdapter | None, version: int) -> None:
        """Serve `adapter` (None: the base model) from now on, under `version`."""
        if adapter is None:
            self._weights, self._scaling, self.version = {}, 0.0, 0
            return
        pairs = split_adapter(adapter)
        param = next(self.layers.parameters())
        weights = {}
        for index in range(len(self.layers)):
            for name, parts in FUSED_PARTS.items():
                found = [pairs.get((index, part)) for part in parts]
                if any(f is not None for f in found):
                    weights[(index, name)] = [None if f is None else
                                              (f[0].to(param.device, torch.float32),
                                               f[1].to(param.device, torch.float32)) for f in found]
        unknown = {layer for layer, _ in pairs} - set(range(len(self.layers)))
        if unknown:
            raise ValueError(f"LoRA tensors for layers {sorted(unknown)}: the model has {len(self.layers)} layers")
        self._weights, self._scaling, self.version = weights, adapter.scaling, version

    def _hook(self, index: int, name: str):
        parts = FUSED_PARTS[name]
        mot = name in _MOT_PROJECTIONS

        def hook(module, args, output):
            weights = self._weights.get((index, name))
            if weights is None:
                return None
            out = output[0] if isinstance(output, tuple) else output
            x = args[0]
            rows = None
            if mot:
                if len(args) < 3 or args[1] is None:  # the understanding mode: no image rows
                    return None
                rows = args[2]
                x = x[rows]
            x = x.float()
            deltas = []
            for part, pair in zip(parts, weights, strict=True):
                if pair is None:  # a part without an adapter: its columns are unchanged
                    deltas.append(x.new_zeros(x.shape[0], _part_width(module, name, parts, part)))
                else:
                    a, b = pair
                    deltas.append((x @ a.T) @ b.T)
            delta = torch.cat(deltas, dim=-1) * self._scaling
            if rows is None:
                out = (out.float() + delta).to(out.dtype)
            else:
                out = out.clone()
                out[rows] = (out[rows].float() + delta).to(out.dtype)
            return (out, *output[1:]) if isinstance(output, tuple) else out

        return hook


def _part_width(module, name: str, parts: tuple[str, ...], part: str) -> int:
    """Output columns of one part of a fused projection (q/k/v of qkv_proj, gate/up of gate_up_proj)."""
    if name == "self_attn.qkv_proj":
        head = module.head_size
        sizes = (module.num_heads * head, module.num_kv_heads * head, module.num_kv_heads * head)
        return sizes[parts.index(part)]
    return module.output_size_per_partition // len(parts)
