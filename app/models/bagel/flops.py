"""Matmul FLOPs of one BAGEL denoising forward of one image (its LLM, a Mixture of Transformers: one expert
runs per token), from the model's shape: 2 per multiply-add; norms, activations and softmax are left out. No torch:
numbers in, numbers out."""

from __future__ import annotations

from dataclasses import dataclass

TIMESTEP_CHANNELS = 256  # sinusoidal timestep features entering the timestep MLP
VIT_PATCH = 14 * 14  # pixels of one SigLIP patch


@dataclass(frozen=True)
class MoT:
    """The sizes the FLOP count needs of BAGEL's LLM (a Mixture of Transformers; one expert runs per token)."""

    num_layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    latent_channels: int = 64  # a latent token: a 2x2 patch of 16 channels

    @classmethod
    def from_config(cls, config) -> MoT:
        """From `BagelMoT.config`."""
        get = config.get if hasattr(config, "get") else (lambda k, d=None: getattr(config, k, d))
        patch = get("latent_patch_size", 2)
        return cls(num_layers=get("num_hidden_layers"), hidden=get("hidden_size"),
                   intermediate=get("intermediate_size"), heads=get("num_attention_heads"),
                   kv_heads=get("num_key_value_heads"), latent_channels=patch * patch * get("latent_channels", 16))


def mot_forward_flops(model: MoT, image_tokens: int, context_tokens: int) -> float:
    """One denoising forward of one image (one CFG branch): its latent tokens (+ start/end of image) through the
    generation expert, attending to a context of `context_tokens` (built once per group: not counted)."""
    d, tokens = model.hidden, image_tokens + 2
    kv = d * model.kv_heads // model.heads
    per_layer = (
        2 * tokens * d * (d + 2 * kv)  # q, k, v
        + 2 * 2 * tokens * (context_tokens + tokens) * d  # QKᵀ and attention·V over context + image
        + 2 * tokens * d * d  # output projection
        + 2 * 3 * tokens * d * model.intermediate  # gate, up, down
    )
    embed = 2 * 2 * image_tokens * model.latent_channels * d + 2 * (TIMESTEP_CHANNELS * d + d * d)
    return model.num_layers * per_layer + embed


def trajectory_forward_flops(config, traj) -> tuple[float, int]:
    """(FLOPs of one denoising forward of one image, forwards per step) of a BAGEL trajectory: the context its
    prompt (and an edit's image blocks: [soi, latents, eoi] and [soi, ViT patches, eoi]) makes, and its CFG
    branches (text CFG; image CFG of an edit)."""
    cond = traj.conditioning
    edit = "edit_latents" in cond
    context = int(cond["prompt_ids"].numel())
    if edit:
        context += cond["edit_latents"].shape[0] + cond["edit_vit"][0].numel() // VIT_PATCH + 4
    cfg = traj.guidance_scale > 1
    branches = 1 + cfg + (cfg and traj.image_guidance_scale > 1 and edit)
    return mot_forward_flops(MoT.from_config(config), traj.latents.shape[2], context), branches
