"""Matmul FLOPs of one Wan transformer forward of one video, from the model's shape: 2 per multiply-add; norms,
activations, softmax and the rotary embedding are left out (a few percent). Checked against torch's own counter on
the real diffusers module (tests/models/test_wan.py). No torch: numbers in, numbers out.

Wan's transformer: the latent video is cut into (1, 2, 2) patches (L tokens) by a 3D convolution; the prompt's S
UMT5 states (padded to 512: every row is attended) are projected once; each block is self-attention over the L
tokens, cross-attention from them to the S states, and a GELU MLP; the timestep's modulation is computed once per
forward (shared by the blocks), then a final projection back to patches.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

TEXT_MLP = 2  # the text projection: Linear(text_dim, d), GELU, Linear(d, d)


@dataclass(frozen=True)
class WanTransformer:
    """The sizes the FLOP count needs (Wan2.1-T2V-1.3B: 30 blocks 1536 wide, MLP 8960; Wan2.2-TI2V-5B: 30 blocks
    3072 wide, MLP 14336; UMT5-XXL's 4096-wide states)."""

    layers: int
    dim: int
    ffn: int
    text_dim: int
    freq_dim: int
    token_values: int  # values per latent token in and out (patch volume x channels)

    @classmethod
    def from_config(cls, config) -> WanTransformer:
        """From a diffusers `WanTransformer3DModel.config` (or any mapping with its keys)."""
        get = config.get if hasattr(config, "get") else (lambda k, d=None: getattr(config, k, d))
        return cls(layers=get("num_layers"), dim=get("num_attention_heads") * get("attention_head_dim"),
                   ffn=get("ffn_dim"), text_dim=get("text_dim"), freq_dim=get("freq_dim"),
                   token_values=prod(get("patch_size")) * get("in_channels"))


def block_flops(model: WanTransformer, tokens: int, text_tokens: int) -> float:
    d, L, S = model.dim, tokens, text_tokens
    self_attention = 2 * L * d * 4 * d + 2 * 2 * L * L * d  # q, k, v, out; QKᵀ and attention·V
    cross_attention = 2 * L * d * 2 * d + 2 * S * d * 2 * d + 2 * 2 * L * S * d  # q, out; k, v of the text; scores
    mlp = 2 * L * d * model.ffn * 2
    return self_attention + cross_attention + mlp


def forward_flops(model: WanTransformer, tokens: int, text_tokens: int) -> float:
    """One transformer forward of one video (one CFG branch)."""
    d = model.dim
    embed = (2 * tokens * model.token_values * d  # the patch convolution
             + 2 * text_tokens * (model.text_dim * d + d * d)  # the text projection
             + 2 * (model.freq_dim * d + d * d) + 2 * d * 6 * d)  # the timestep MLP and its modulation
    head = 2 * tokens * d * model.token_values
    return model.layers * block_flops(model, tokens, text_tokens) + embed + head


def trajectory_forward_flops(config, traj) -> tuple[float, int]:
    """(FLOPs of one transformer forward of one video, forwards per step: 2 under CFG, else 1) of a Wan
    trajectory."""
    model = WanTransformer.from_config(config)
    f, h, w = traj.latents.shape[-3:]
    p = config.get("patch_size") if hasattr(config, "get") else config.patch_size
    tokens = (f // p[0]) * (h // p[1]) * (w // p[2])
    return forward_flops(model, tokens, traj.prompt_embeds.shape[0]), 2 if traj.do_cfg else 1
