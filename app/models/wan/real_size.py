"""Random Wan checkpoints at the real sizes, built locally (no hub access exists on our machines).

Two presets, the architectures vllm-omni 0.30's `wan2_2` serves: Wan2.1-T2V-1.3B (30 blocks 1536 wide, 12 heads, MLP
8960, 16 latent channels, Wan2.1's VAE, flow_shift 3 for 480p) and Wan2.2-TI2V-5B (30 blocks 3072 wide, 24 heads, MLP
14336, 48 latent channels, Wan2.2's 16x-spatial VAE, one timestep a token, flow_shift 5). The transformers are
Wan's own configs; the text encoder has UMT5-XXL's width but only `text_layers` layers, since prompt encoding is a
small share of the work; the tokenizer is the tiny one. Weights are bf16, drawn from N(0, 0.02) per matrix (norm
scales 1, biases 0: `builds.randomise`) by one seeded generator on the build device; the VAEs keep diffusers' own
initialisation, seeded. The scheduler is Wan's UniPC on flow sigmas with the model's shift.

What it is for: throughput and memory measurements through the normal `model.path` route (a diffusers-layout
folder, loaded as a user's real checkpoint would be). It generates noise, not videos.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from app.models import builds
from app.models.builds import train_tokenizer

BUILDER_VERSION = 1
COMMON = dict(patch_size=(1, 2, 2), attention_head_dim=128, text_dim=4096, freq_dim=256, cross_attn_norm=True,
              qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024)
MODELS = {
    "wan2.1-t2v-1.3b": dict(
        transformer=dict(COMMON, num_attention_heads=12, in_channels=16, out_channels=16, ffn_dim=8960),
        vae={}, flow_shift=3.0, expand_timesteps=False),  # Wan2.1's VAE: diffusers' defaults
    "wan2.2-ti2v-5b": dict(
        transformer=dict(COMMON, num_attention_heads=24, in_channels=48, out_channels=48, ffn_dim=14336),
        # Wan2.2's VAE: 16x spatially (a 2x2 pixel patch before a residual 8x encoder), 48 channels
        vae=dict(base_dim=160, decoder_base_dim=256, z_dim=48, is_residual=True, in_channels=12, out_channels=12,
                 patch_size=2, scale_factor_spatial=16, latents_mean=[0.0] * 48, latents_std=[1.0] * 48),
        flow_shift=5.0, expand_timesteps=True),
}
UMT5_XXL = dict(d_model=4096, d_kv=64, d_ff=10240, num_heads=64, relative_attention_num_buckets=32,
                relative_attention_max_distance=128, feed_forward_proj="gated-gelu")


def random_components(preset: str, seed: int = 0, *, num_layers: int = 30, text_layers: int = 2,
                      device: str | torch.device = "cuda", dtype: torch.dtype = torch.bfloat16) -> dict:
    """The five pipeline components of `preset` (and the pipeline's `expand_timesteps`); fewer blocks give a
    shallower transformer of the real width."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    spec = MODELS[preset]
    tokenizer = train_tokenizer()
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.device("meta"):
        transformer = WanTransformer3DModel(**spec["transformer"], num_layers=num_layers)
    transformer = transformer.to_empty(device=device).to(dtype)
    builds.randomise(transformer, generator)
    with torch.device(device):
        text_encoder = UMT5EncoderModel(UMT5Config(
            vocab_size=len(tokenizer), num_layers=text_layers, pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id, decoder_start_token_id=tokenizer.pad_token_id,
            **UMT5_XXL)).to(dtype).eval()
    builds.randomise(text_encoder, generator)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        vae = AutoencoderKLWan(**spec["vae"]).to(device, torch.float32)  # Wan decodes in fp32
    scheduler = UniPCMultistepScheduler(num_train_timesteps=1000, prediction_type="flow_prediction",
                                        use_flow_sigmas=True, flow_shift=spec["flow_shift"])
    return dict(transformer=transformer, scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                expand_timesteps=spec["expand_timesteps"])


def build_random_wan(preset: str, out_dir: str | os.PathLike, seed: int = 0, *, num_layers: int = 30,
                     text_layers: int = 2, device: str | torch.device | None = None,
                     overwrite: bool = False) -> Path:
    """Write the checkpoint to `out_dir` (bf16, diffusers layout) unless the same build is already there; the
    folder is written next to its destination and renamed into place."""
    from diffusers import WanPipeline

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    out = Path(out_dir).resolve()
    wanted = {"family": "wan", "preset": preset, "seed": seed, "num_layers": num_layers, "text_layers": text_layers,
              "builder_version": BUILDER_VERSION}

    def save(staging: Path) -> None:
        components = random_components(preset, seed, num_layers=num_layers, text_layers=text_layers, device=device)
        WanPipeline(**components).save_pretrained(staging, max_shard_size="5GB")

    return builds.write_build(out, wanted, save, overwrite=overwrite)


def build_random_wan_1_3b(out_dir, seed: int = 0, *, num_layers: int = 30, overwrite: bool = False) -> Path:
    return build_random_wan("wan2.1-t2v-1.3b", out_dir, seed, num_layers=num_layers, overwrite=overwrite)


def build_random_wan_5b(out_dir, seed: int = 0, *, num_layers: int = 30, overwrite: bool = False) -> Path:
    return build_random_wan("wan2.2-ti2v-5b", out_dir, seed, num_layers=num_layers, overwrite=overwrite)
