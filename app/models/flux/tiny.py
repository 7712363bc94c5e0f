"""Deterministic tiny random FLUX.1 checkpoints, built locally (no hub access exists on our machines).

The checkpoint has FLUX.1-dev's diffusers layout (`model_index.json`, `transformer/`, `vae/`, `text_encoder/`
CLIP-L, `text_encoder_2/` T5, their tokenizers, `scheduler/`) in fp32, so diffusers' `FluxPipeline` and vllm-omni's
FLUX pipeline load it like the real model. The transformer has FLUX.1-dev's features at a tiny width: double-stream
blocks then single-stream ones, the guidance embedding of a guidance-distilled model, 3-axis rotary positions, 2x2
packed latents (64 values a token); the scheduler shifts by image size as FLUX.1-dev's does. Same seed → identical
tensors and tokenizers (the tokenizers are SD3's tiny ones: app/models/sd3/tiny.py).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from app.models.builds import write_build

BUILDER_VERSION = 1  # bump when the architecture below changes, so cached checkpoints are rebuilt

CLIP_HIDDEN = 16  # CLIP-L's width and the pooled projection the transformer takes
T5_HIDDEN = 32  # == transformer joint_attention_dim
LATENT_CHANNELS = 16
TRANSFORMER = dict(patch_size=1, in_channels=4 * LATENT_CHANNELS, num_layers=2, num_single_layers=2,
                   attention_head_dim=8, num_attention_heads=4, joint_attention_dim=T5_HIDDEN,
                   pooled_projection_dim=CLIP_HIDDEN, guidance_embeds=True, axes_dims_rope=(2, 2, 4))
# FLUX.1-dev's latent normalisation (its VAE's scaling and shift factors) and its scheduler
VAE_SCALING, VAE_SHIFT = 0.3611, 0.1159
SCHEDULER = dict(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                 base_image_seq_len=256, max_image_seq_len=4096)


def tiny_flux_components(seed: int = 0) -> dict:
    """The seven pipeline components, random but reproducible: same seed → identical tensors."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    from app.models.sd3.tiny import CLIP_MAX_LENGTH, CLIP_SPECIALS, train_clip_tokenizer, train_t5_tokenizer

    clip_tokenizer, t5_tokenizer = train_clip_tokenizer(), train_t5_tokenizer()
    bos, eos = (clip_tokenizer.convert_tokens_to_ids(t) for t in CLIP_SPECIALS)
    with torch.random.fork_rng(devices=[]):  # the caller's RNG state is left alone
        torch.manual_seed(seed)
        text_encoder = CLIPTextModel(CLIPTextConfig(
            vocab_size=len(clip_tokenizer), hidden_size=CLIP_HIDDEN, intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=2, projection_dim=CLIP_HIDDEN, max_position_embeddings=CLIP_MAX_LENGTH,
            bos_token_id=bos, eos_token_id=eos, pad_token_id=eos, hidden_act="quick_gelu")).eval()
        text_encoder_2 = T5EncoderModel(T5Config(
            vocab_size=len(t5_tokenizer), d_model=T5_HIDDEN, d_kv=8, d_ff=32, num_layers=2, num_heads=4,
            feed_forward_proj="gated-gelu", pad_token_id=t5_tokenizer.pad_token_id,
            eos_token_id=t5_tokenizer.eos_token_id, decoder_start_token_id=t5_tokenizer.pad_token_id)).eval()
        transformer = FluxTransformer2DModel(**TRANSFORMER)
        vae = AutoencoderKL(in_channels=3, out_channels=3, latent_channels=LATENT_CHANNELS,
                            block_out_channels=(8, 16, 16, 16), down_block_types=["DownEncoderBlock2D"] * 4,
                            up_block_types=["UpDecoderBlock2D"] * 4, layers_per_block=1, norm_num_groups=4,
                            sample_size=64, scaling_factor=VAE_SCALING, shift_factor=VAE_SHIFT, use_quant_conv=False,
                            use_post_quant_conv=False)
    return dict(transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER), vae=vae,
                text_encoder=text_encoder, tokenizer=clip_tokenizer, text_encoder_2=text_encoder_2,
                tokenizer_2=t5_tokenizer)


def build_tiny_flux(out_dir: str | os.PathLike, seed: int = 0, *, overwrite: bool = False) -> Path:
    """Write a tiny checkpoint to `out_dir` (fp32, diffusers layout) unless an identical build is already there."""
    def save(staging: Path) -> None:
        from diffusers import FluxPipeline  # only when building: the import is seconds of a job's start

        FluxPipeline(**tiny_flux_components(seed)).save_pretrained(staging)

    out = Path(out_dir).resolve()
    wanted = {"family": "flux", "seed": seed, "builder_version": BUILDER_VERSION}
    return write_build(out, wanted, save, overwrite=overwrite)
