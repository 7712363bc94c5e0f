"""Matmul FLOPs of one Qwen-Image transformer (MMDiT) forward of one image, from the model's shape: 2 per
multiply-add; norms, activations and softmax are left out (a few percent). Checked against torch's own counter on
the real diffusers module (tests/test_flops.py). No torch: numbers in, numbers out."""

from __future__ import annotations

from dataclasses import dataclass

TIMESTEP_CHANNELS = 256  # sinusoidal timestep features entering the timestep MLP


@dataclass(frozen=True)
class MMDiT:
    """The sizes the FLOP count needs (Qwen-Image: 60 blocks, 3072 wide, MLP 4x, text states 3584 wide)."""

    num_layers: int
    dim: int
    text_dim: int
    in_channels: int  # packed latent channels per image token (64)
    out_channels: int  # per image token after unpatchifying: patch² x z (2·2·16 = 64)
    mlp_ratio: int = 4

    @classmethod
    def from_config(cls, config) -> MMDiT:
        """From a diffusers `QwenImageTransformer2DModel.config` (or any mapping with its keys)."""
        get = config.get if hasattr(config, "get") else (lambda k, d=None: getattr(config, k, d))
        dim = get("num_attention_heads") * get("attention_head_dim")
        patch = get("patch_size", 2)
        return cls(num_layers=get("num_layers"), dim=dim, text_dim=get("joint_attention_dim"),
                   in_channels=get("in_channels"), out_channels=patch * patch * (get("out_channels") or 16))


def forward_flops(model: MMDiT, image_tokens: int, text_tokens: int) -> float:
    """One transformer forward of one image (one CFG branch)."""
    d, tokens = model.dim, image_tokens + text_tokens
    per_block = (
        2 * tokens * d * 3 * d  # q, k, v of both streams
        + 2 * 2 * tokens * tokens * d  # QKᵀ and attention·V over the joint sequence
        + 2 * tokens * d * d  # output projections
        + 2 * 2 * tokens * d * model.mlp_ratio * d  # the two MLP matrices of both streams
        + 2 * 2 * d * 6 * d  # the two streams' modulation (once per image, not per token)
    )
    embed = (2 * image_tokens * model.in_channels * d + 2 * text_tokens * model.text_dim * d
             + 2 * (TIMESTEP_CHANNELS * d + d * d))  # patch and text projections, the timestep MLP
    head = 2 * d * 2 * d + 2 * image_tokens * d * model.out_channels  # final modulation + projection
    return model.num_layers * per_block + embed + head


def trajectory_forward_flops(config, traj) -> tuple[float, int]:
    """(FLOPs of one transformer forward of one image, forwards per step: 2 under true CFG) of a Qwen-Image
    trajectory (its image tokens and the prompt's text states)."""
    model = MMDiT.from_config(config)
    return forward_flops(model, traj.latents.shape[2], int(traj.prompt_mask.sum())), 2 if traj.do_cfg else 1
