"""Matmul FLOPs of one FLUX.1 transformer forward of one image, from the model's shape: 2 per multiply-add; norms,
activations, softmax and the rotary embedding are left out (a few percent). Checked against torch's own counter on
the real diffusers module (tests/models/test_flux.py). No torch: numbers in, numbers out.

FLUX.1's transformer: double-stream blocks (MMDiT: joint attention over text + image tokens, separate projections
and MLPs per stream, both streams' outputs projected) then single-stream blocks over the joined sequence (one
fused input: q, k, v and the MLP's first layer side by side; one output projection of attention and MLP together).
"""

from __future__ import annotations

from dataclasses import dataclass

TIMESTEP_CHANNELS = 256  # sinusoidal features entering the timestep MLP (and the guidance MLP)


@dataclass(frozen=True)
class FluxTransformer:
    """The sizes the FLOP count needs (FLUX.1-dev: 19 double and 38 single blocks 3072 wide, T5 states 4096 wide,
    CLIP's pooled 768, 64 values a packed token, the guidance embedding)."""

    double_layers: int
    single_layers: int
    dim: int
    text_dim: int  # joint_attention_dim: the text states' width
    pooled_dim: int
    token_in: int  # values per image token entering x_embedder (in_channels: 4 x 16 latent channels)
    token_out: int  # per image token leaving proj_out
    guidance_embeds: bool
    mlp_ratio: int = 4

    @classmethod
    def from_config(cls, config) -> FluxTransformer:
        """From a diffusers `FluxTransformer2DModel.config` (or any mapping with its keys)."""
        get = config.get if hasattr(config, "get") else (lambda k, d=None: getattr(config, k, d))
        patch = get("patch_size", 1)
        channels = get("in_channels")
        return cls(double_layers=get("num_layers"), single_layers=get("num_single_layers"),
                   dim=get("num_attention_heads") * get("attention_head_dim"), text_dim=get("joint_attention_dim"),
                   pooled_dim=get("pooled_projection_dim"), token_in=patch * patch * channels,
                   token_out=patch * patch * (get("out_channels") or channels),
                   guidance_embeds=bool(get("guidance_embeds", False)))


def forward_flops(model: FluxTransformer, image_tokens: int, text_tokens: int) -> float:
    """One transformer forward of one image (one CFG branch)."""
    d, mlp = model.dim, model.mlp_ratio
    tokens = image_tokens + text_tokens
    attention = 2 * 2 * tokens * tokens * d  # QKᵀ and attention·V over the joint sequence
    double = (2 * tokens * d * 3 * d + attention  # q, k, v of both streams, attention
              + 2 * tokens * d * d  # both streams' output projections
              + 2 * 2 * tokens * d * mlp * d  # both streams' MLPs
              + 2 * 2 * d * 6 * d)  # AdaLayerNormZero of each stream (once per image)
    single = (2 * tokens * d * (3 + mlp) * d + attention  # the fused input projection (q, k, v, MLP in), attention
              + 2 * tokens * (1 + mlp) * d * d  # the output projection of attention and MLP together
              + 2 * d * 3 * d)  # AdaLayerNormZeroSingle
    embedders = 2 + int(model.guidance_embeds)  # timestep, pooled text, guidance: a two-layer MLP each
    embed = (2 * image_tokens * model.token_in * d + 2 * text_tokens * model.text_dim * d
             + 2 * (TIMESTEP_CHANNELS * d + d * d) * (embedders - 1) + 2 * (model.pooled_dim * d + d * d))
    head = 2 * d * 2 * d + 2 * image_tokens * d * model.token_out  # AdaLayerNormContinuous + projection
    return model.double_layers * double + model.single_layers * single + embed + head


def trajectory_forward_flops(config, traj) -> tuple[float, int]:
    """(FLOPs of one transformer forward of one image, forwards per step: 2 under true CFG, else 1: a
    guidance-distilled model's guidance is an input, not a branch) of a FLUX trajectory."""
    model = FluxTransformer.from_config(config)
    return forward_flops(model, traj.latents.shape[-2], int(traj.prompt_mask.sum())), 2 if traj.do_cfg else 1
