"""Matmul FLOPs of one Z-Image transformer forward of one image, from the model's shape: 2 per multiply-add; norms,
activations, softmax and the rotary embedding are left out (a few percent). Checked against torch's own counter on
the real diffusers module (tests/models/test_z_image.py). No torch: numbers in, numbers out.

Z-Image's transformer (S3-DiT): the image tokens go through `n_refiner_layers` noise-refiner blocks and the caption
tokens through as many context-refiner blocks, then both, joined, through `n_layers` single-stream blocks; each
sequence is padded to a multiple of 32 tokens (pad tokens are computed like the others), and the final layer
projects the whole joined sequence. A block: attention (q, k, v, out: diffusers builds k and v at full width
whatever `n_kv_heads` says; Z-Image's equals `n_heads`), a SwiGLU MLP 8/3 as wide, and (noise refiner and main
blocks) an adaLN modulation from the timestep embedding.
"""

from __future__ import annotations

from dataclasses import dataclass

SEQ_MULTI_OF = 32  # diffusers' and vllm-omni's padding of each sequence
TIMESTEP_CHANNELS = 256  # sinusoidal features entering the timestep MLP
ADALN_EMBED_DIM = 256  # the timestep embedding's width is min(dim, 256)
TIMESTEP_MID = 1024  # the timestep MLP's hidden width


@dataclass(frozen=True)
class ZImageTransformer:
    """The sizes the FLOP count needs (Z-Image: 30 blocks 3840 wide, 2 refiner blocks of each kind,
    Qwen3-4B captions 2560 wide, 2x2 patches of 16 latent channels)."""

    layers: int
    refiner_layers: int
    dim: int
    caption_dim: int
    token_values: int  # values per image token in and out (patch² x channels)

    @classmethod
    def from_config(cls, config) -> ZImageTransformer:
        """From a diffusers `ZImageTransformer2DModel.config` (or any mapping with its keys)."""
        get = config.get if hasattr(config, "get") else (lambda k, d=None: getattr(config, k, d))
        patch, frames = get("all_patch_size", (2,))[0], get("all_f_patch_size", (1,))[0]
        return cls(layers=get("n_layers"), refiner_layers=get("n_refiner_layers"), dim=get("dim"),
                   caption_dim=get("cap_feat_dim"),
                   token_values=frames * patch * patch * get("in_channels"))


def padded(tokens: int) -> int:
    return tokens + (-tokens) % SEQ_MULTI_OF


def block_flops(model: ZImageTransformer, tokens: int, modulated: bool) -> float:
    d = model.dim
    ffn = int(d / 3 * 8)
    return (2 * tokens * d * 3 * d  # q, k, v
            + 2 * 2 * tokens * tokens * d  # QKᵀ and attention·V
            + 2 * tokens * d * d  # out
            + 2 * tokens * d * ffn * 3  # SwiGLU: w1, w3 in, w2 out
            + (2 * min(d, ADALN_EMBED_DIM) * 4 * d if modulated else 0))  # adaLN modulation (once per image)


def forward_flops(model: ZImageTransformer, image_tokens: int, caption_tokens: int) -> float:
    """One transformer forward of one image (one CFG branch)."""
    d = model.dim
    x, cap = padded(image_tokens), padded(caption_tokens)
    refiners = model.refiner_layers * (block_flops(model, x, True) + block_flops(model, cap, False))
    main = model.layers * block_flops(model, x + cap, True)
    adaln = min(d, ADALN_EMBED_DIM)
    embed = (2 * x * model.token_values * d + 2 * cap * model.caption_dim * d  # both embedders see the padding too
             + 2 * (TIMESTEP_CHANNELS * TIMESTEP_MID + TIMESTEP_MID * adaln))  # the timestep MLP
    head = 2 * adaln * d + 2 * (x + cap) * d * model.token_values  # the final layer: the whole joined sequence
    return refiners + main + embed + head


def trajectory_forward_flops(config, traj) -> tuple[float, int]:
    """(FLOPs of one transformer forward of one image, forwards per step: 2 under CFG, else 1) of a Z-Image
    trajectory."""
    model = ZImageTransformer.from_config(config)
    h, w = traj.latents.shape[-2:]
    patch = 2
    return forward_flops(model, (h // patch) * (w // patch), int(traj.prompt_mask.sum())), 2 if traj.do_cfg else 1
