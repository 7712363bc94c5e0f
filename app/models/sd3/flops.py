"""Matmul FLOPs of one SD3 transformer (MMDiT) forward of one image, from the model's shape: 2 per multiply-add;
norms, activations and softmax are left out (a few percent). Checked against torch's own counter on the real
diffusers module (tests/models/test_sd3.py). No torch: numbers in, numbers out.

SD3.5's MMDiT: every block runs joint attention over text + image tokens with separate projections and MLPs per
stream; the dual-attention blocks (SD3.5-Medium: 0-12) add a second attention over the image tokens alone; the last
block's text stream stops after attention (`context_pre_only`: no text output projection or MLP).
"""

from __future__ import annotations

from dataclasses import dataclass

TIMESTEP_CHANNELS = 256  # sinusoidal timestep features entering the timestep MLP


@dataclass(frozen=True)
class SD3MMDiT:
    """The sizes the FLOP count needs (SD3.5-Medium: 24 blocks 1536 wide, 13 of them dual, text states 4096 wide,
    pooled 2048)."""

    num_layers: int
    dim: int
    text_dim: int  # joint_attention_dim: the text states' width
    pooled_dim: int
    dual_layers: int  # blocks with the second, image-only attention
    patch_in: int  # latent values per image token entering the patch embedding (patch² x channels)
    patch_out: int  # per image token leaving the final projection
    mlp_ratio: int = 4

    @classmethod
    def from_config(cls, config) -> SD3MMDiT:
        """From a diffusers `SD3Transformer2DModel.config` (or any mapping with its keys)."""
        get = config.get if hasattr(config, "get") else (lambda k, d=None: getattr(config, k, d))
        patch = get("patch_size", 2)
        dual = [i for i in (get("dual_attention_layers") or ()) if i < get("num_layers")]
        return cls(num_layers=get("num_layers"), dim=get("num_attention_heads") * get("attention_head_dim"),
                   text_dim=get("joint_attention_dim"), pooled_dim=get("pooled_projection_dim"),
                   dual_layers=len(dual), patch_in=patch * patch * get("in_channels"),
                   patch_out=patch * patch * (get("out_channels") or get("in_channels")))


def forward_flops(model: SD3MMDiT, image_tokens: int, text_tokens: int) -> float:
    """One transformer forward of one image (one CFG branch)."""
    d, tokens, mlp = model.dim, image_tokens + text_tokens, model.mlp_ratio
    joint = (2 * tokens * d * 3 * d  # q, k, v of both streams
             + 2 * 2 * tokens * tokens * d  # QKᵀ and attention·V over the joint sequence
             + 2 * image_tokens * d * d  # the image stream's output projection
             + 2 * 2 * image_tokens * d * mlp * d)  # the image stream's MLP
    text_out = 2 * text_tokens * d * d + 2 * 2 * text_tokens * d * mlp * d  # text output projection and MLP
    second = 2 * image_tokens * d * 4 * d + 2 * 2 * image_tokens * image_tokens * d  # a dual block's 2nd attention
    modulation = 2 * d * 6 * d  # AdaLayerNormZero of one stream (once per image, not per token)
    blocks = (model.num_layers * (joint + modulation)  # image stream modulation
              + (model.num_layers - 1) * (text_out + modulation)  # text streams that go on past attention
              + 2 * d * 2 * d  # the last block's text norm (AdaLayerNormContinuous)
              + model.dual_layers * (second + 2 * d * 3 * d))  # plus 3 modulation vectors for the 2nd attention
    embed = (2 * image_tokens * model.patch_in * d + 2 * text_tokens * model.text_dim * d
             + 2 * (TIMESTEP_CHANNELS * d + d * d) + 2 * (model.pooled_dim * d + d * d))  # patch, text, t, pooled
    head = 2 * d * 2 * d + 2 * image_tokens * d * model.patch_out  # final modulation + projection
    return blocks + embed + head


def trajectory_forward_flops(config, traj) -> tuple[float, int]:
    """(FLOPs of one transformer forward of one image, forwards per step: 2 under CFG) of an SD3 trajectory."""
    model = SD3MMDiT.from_config(config)
    patch = config.get("patch_size", 2) if hasattr(config, "get") else config.patch_size
    image_tokens = (traj.latents.shape[-2] // patch) * (traj.latents.shape[-1] // patch)
    return forward_flops(model, image_tokens, int(traj.prompt_mask.sum())), 2 if traj.do_cfg else 1
