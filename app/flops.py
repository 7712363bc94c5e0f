"""Useful FLOPs of a FlowGRPO step and the model FLOPs utilisation (MFU) they make.

Counted from the model's shape, per image, as matrix-multiply FLOPs (2 per multiply-add); norms, activations,
softmax and the SDE step are left out (a few percent). `useful` means the work the algorithm needs: rollout
forwards (both CFG branches), the trainer's forward and its input-gradient backward (the LoRA weight gradients
are a rounding error), the reference forwards of the KL. Recomputation (gradient checkpointing, recomputed old
log-probs) is not useful work, so it lowers the MFU instead of raising it.

No torch, no Ray: numbers in, numbers out.
"""

from __future__ import annotations

from dataclasses import dataclass

# dense bf16 of one H100 / H200 SXM (the vendor's datasheet; measured matmuls reach ~790 TFLOP/s)
PEAK_BF16_FLOPS = 989e12
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


def step_flops(forward: float, *, images: int, num_inference_steps: int, trained_steps: int, cfg: bool,
               kl: bool, branches: int | None = None) -> dict[str, float]:
    """Useful FLOPs of one step that samples `images` images of `num_inference_steps` steps and trains
    `trained_steps` of each; `forward` = `forward_flops` of one image; `branches`: forwards per step (default 2
    with CFG, else 1; BAGEL's image CFG makes 3)."""
    branches = branches or (2 if cfg else 1)
    rollout = images * num_inference_steps * branches * forward
    train = images * trained_steps * branches * forward * 2  # forward + input-gradient backward
    reference = images * trained_steps * branches * forward if kl else 0.0
    return {"rollout": rollout, "train": train, "reference": reference, "total": rollout + train + reference}


def mfu(flops: float, seconds: float, gpus: float, peak: float = PEAK_BF16_FLOPS) -> float:
    """Model FLOPs utilisation: useful FLOPs over what `gpus` GPUs could do in `seconds`."""
    return flops / (gpus * peak * seconds)
