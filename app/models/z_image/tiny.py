"""Deterministic tiny random Z-Image checkpoints, built locally (no hub access exists on our machines).

The checkpoint has Z-Image-Turbo's diffusers layout (`model_index.json`, `transformer/`, `vae/`, `text_encoder/`
Qwen3, `tokenizer/`, `scheduler/`) in fp32, so diffusers' `ZImagePipeline` and vllm-omni's Z-Image pipeline load it
like the real model. The transformer has Z-Image's features at a tiny width: a single stream of blocks over image
and caption tokens, noise and context refiners before it, grouped-query attention with q/k norms, 3-axis rotary
positions, latents patchified 2x2 inside it, the timestep as 1 − σ. The text encoder is a 2-layer Qwen3 with our
Qwen2 tokenizer (app/models/builds.py) and a chat template that wraps a prompt as Qwen3's does with thinking on.
The VAE's normalisation is FLUX's (Z-Image uses FLUX's autoencoder); the scheduler is Z-Image-Turbo's (shift 3, no
size-dependent shift). Same seed → identical tensors and tokenizer.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from app.models.builds import train_tokenizer, write_build

BUILDER_VERSION = 1  # bump when the architecture below changes, so cached checkpoints are rebuilt

TEXT_HIDDEN = 32  # == transformer cap_feat_dim
LATENT_CHANNELS = 16
TRANSFORMER = dict(all_patch_size=(2,), all_f_patch_size=(1,), in_channels=LATENT_CHANNELS, dim=32, n_layers=2,
                   n_refiner_layers=1, n_heads=2, n_kv_heads=2, norm_eps=1e-5, qk_norm=True,
                   cap_feat_dim=TEXT_HIDDEN, rope_theta=256.0, t_scale=1000.0, axes_dims=[4, 6, 6],
                   axes_lens=[1024, 128, 128])
VAE_SCALING, VAE_SHIFT = 0.3611, 0.1159  # FLUX's autoencoder, which Z-Image uses
SCHEDULER = dict(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False)  # Z-Image-Turbo's
# Qwen3's chat template for one user turn with the generation prompt, thinking on (what both pipelines ask for:
# `apply_chat_template(..., add_generation_prompt=True, enable_thinking=True)`)
CHAT_TEMPLATE = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
                 "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                 "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
                 "{% endif %}")


def tiny_tokenizer():
    tokenizer = train_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def tiny_z_image_components(seed: int = 0) -> dict:
    """The five pipeline components, random but reproducible: same seed → identical tensors."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, ZImageTransformer2DModel
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tokenizer = tiny_tokenizer()
    with torch.random.fork_rng(devices=[]):  # the caller's RNG state is left alone
        torch.manual_seed(seed)
        text_encoder = Qwen3ForCausalLM(Qwen3Config(
            vocab_size=len(tokenizer), hidden_size=TEXT_HIDDEN, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=1024,
            tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id)).eval()
        transformer = ZImageTransformer2DModel(**TRANSFORMER)
        vae = AutoencoderKL(in_channels=3, out_channels=3, latent_channels=LATENT_CHANNELS,
                            block_out_channels=(8, 16, 16, 16), down_block_types=["DownEncoderBlock2D"] * 4,
                            up_block_types=["UpDecoderBlock2D"] * 4, layers_per_block=1, norm_num_groups=4,
                            sample_size=64, scaling_factor=VAE_SCALING, shift_factor=VAE_SHIFT, use_quant_conv=False,
                            use_post_quant_conv=False)
    return dict(transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER), vae=vae,
                text_encoder=text_encoder, tokenizer=tokenizer)


def build_tiny_z_image(out_dir: str | os.PathLike, seed: int = 0, *, overwrite: bool = False) -> Path:
    """Write a tiny checkpoint to `out_dir` (fp32, diffusers layout) unless an identical build is already there."""
    def save(staging: Path) -> None:
        from diffusers import ZImagePipeline  # only when building: the import is seconds of a job's start

        ZImagePipeline(**tiny_z_image_components(seed)).save_pretrained(staging)

    out = Path(out_dir).resolve()
    wanted = {"family": "z_image", "seed": seed, "builder_version": BUILDER_VERSION}
    return write_build(out, wanted, save, overwrite=overwrite)
