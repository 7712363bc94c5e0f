"""Deterministic tiny random Wan checkpoints, built locally (no hub access exists on our machines).

The checkpoint has Wan2.1-T2V's diffusers layout (`model_index.json`, `transformer/`, `vae/`, `text_encoder/`
UMT5, `tokenizer/`, `scheduler/`) in fp32, so diffusers' `WanPipeline` and vllm-omni's Wan pipeline load it like
the real model. The transformer has Wan's features at a tiny width: 3D patches (1, 2, 2) of a video latent, 3-axis
rotary positions (frame, row, column), self-attention with RMS q/k norms across heads, cross-attention to the UMT5
states, a GELU MLP, adaLN modulation from the timestep. The VAE is Wan's causal 3D autoencoder (8x spatial, 4x
temporal: a video of 4k + 1 frames has k + 1 latent frames) at a tiny width; the text encoder a 2-layer UMT5 with
our tokenizer (app/models/builds.py). The scheduler is Wan2.1's (UniPC on flow sigmas, 480p's flow_shift 3): the
FlowGRPO rollout reads its shift and steps the SDE on the same points (app/models/wan/model.py). Same seed →
identical tensors and tokenizer.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from app.models.builds import train_tokenizer, write_build

BUILDER_VERSION = 3  # bump when the architecture below changes, so cached checkpoints are rebuilt

TEXT_HIDDEN = 32  # == transformer text_dim
LATENT_CHANNELS = 16
# a head of 24: vllm-omni 0.30's Wan RoPE splits a head by head // 3 where its frequencies were built by 2 (head // 6)
# (the same at Wan's 128, not at 16), so a smaller head would not be the model vllm-omni serves
TRANSFORMER = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=24, in_channels=LATENT_CHANNELS,
                   out_channels=LATENT_CHANNELS, text_dim=TEXT_HIDDEN, freq_dim=32, ffn_dim=64, num_layers=2,
                   cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024)
VAE = dict(base_dim=8, z_dim=LATENT_CHANNELS, dim_mult=[1, 1, 1, 1], num_res_blocks=1, attn_scales=[],
           temperal_downsample=[False, True, True])
SCHEDULER = dict(num_train_timesteps=1000, prediction_type="flow_prediction", use_flow_sigmas=True,
                 flow_shift=3.0)  # Wan2.1's, 480p's shift


def tiny_wan_components(seed: int = 0) -> dict:
    """The five pipeline components, random but reproducible: same seed → identical tensors."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    tokenizer = train_tokenizer()
    with torch.random.fork_rng(devices=[]):  # the caller's RNG state is left alone
        torch.manual_seed(seed)
        text_encoder = UMT5EncoderModel(UMT5Config(
            vocab_size=len(tokenizer), d_model=TEXT_HIDDEN, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
            relative_attention_num_buckets=8, relative_attention_max_distance=32, feed_forward_proj="gated-gelu",
            pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
            decoder_start_token_id=tokenizer.pad_token_id)).eval()
        transformer = WanTransformer3DModel(**TRANSFORMER)
        vae = AutoencoderKLWan(**VAE)
    return dict(transformer=transformer, scheduler=UniPCMultistepScheduler(**SCHEDULER), vae=vae,
                text_encoder=text_encoder, tokenizer=tokenizer)


def build_tiny_wan(out_dir: str | os.PathLike, seed: int = 0, *, overwrite: bool = False) -> Path:
    """Write a tiny checkpoint to `out_dir` (fp32, diffusers layout) unless an identical build is already there."""
    def save(staging: Path) -> None:
        from diffusers import WanPipeline  # only when building: the import is seconds of a job's start

        WanPipeline(**tiny_wan_components(seed)).save_pretrained(staging)

    out = Path(out_dir).resolve()
    wanted = {"family": "wan", "seed": seed, "builder_version": BUILDER_VERSION}
    return write_build(out, wanted, save, overwrite=overwrite)
