"""Random Z-Image checkpoints at the real size, built locally (no hub access exists on our machines).

The transformer is Z-Image's own, from its published config: 30 single-stream blocks and 2 refiner blocks of each
kind, 3840 wide, 30 heads of 128, Qwen3-4B's 2560-wide captions, 2x2 patches of 16 latent channels (6.2B
parameters); the VAE is FLUX's autoencoder (Z-Image uses it) and the scheduler Z-Image-Turbo's. The text encoder
has Qwen3-4B's width but only `text_layers` layers, since prompt encoding is a small share of the work; the
tokenizer is the tiny one (app/models/z_image/tiny.py). Weights are bf16, drawn from N(0, 0.02) per matrix (norm
scales 1, biases 0: `builds.randomise`) by one seeded generator on the build device; the transformer is made on
the meta device and materialised straight on it.

What it is for: throughput and memory measurements through the normal `model.path` route (a diffusers-layout
folder, loaded as a user's real checkpoint would be). It generates noise, not pictures.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from app.models import builds
from app.models.flux.real_size import VAE
from app.models.z_image import tiny

PRESET = "z-image"
BUILDER_VERSION = 1
TRANSFORMER = dict(all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=3840, n_layers=30,
                   n_refiner_layers=2, n_heads=30, n_kv_heads=30, norm_eps=1e-5, qk_norm=True, cap_feat_dim=2560,
                   rope_theta=256.0, t_scale=1000.0, axes_dims=[32, 48, 48], axes_lens=[1024, 512, 512])
QWEN3_4B = dict(hidden_size=2560, intermediate_size=9728, num_attention_heads=32, num_key_value_heads=8,
                head_dim=128, max_position_embeddings=40960, rope_theta=1000000.0, tie_word_embeddings=True)


def random_components(seed: int = 0, *, n_layers: int = 30, text_layers: int = 2,
                      device: str | torch.device = "cuda", dtype: torch.dtype = torch.bfloat16) -> dict:
    """The five pipeline components; fewer blocks give a shallower transformer of the real width."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, ZImageTransformer2DModel
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tokenizer = tiny.tiny_tokenizer()
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.device("meta"):
        transformer = ZImageTransformer2DModel(**{**TRANSFORMER, "n_layers": n_layers})
    transformer = transformer.to_empty(device=device).to(dtype)
    builds.randomise(transformer, generator)
    with torch.device(device):
        text_encoder = Qwen3ForCausalLM(Qwen3Config(
            vocab_size=len(tokenizer), num_hidden_layers=text_layers, pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id, **QWEN3_4B)).to(dtype).eval()
    builds.randomise(text_encoder, generator)
    with torch.random.fork_rng(devices=[]):  # the VAE keeps diffusers' own init (84M parameters), seeded
        torch.manual_seed(seed)
        vae = AutoencoderKL(**VAE).to(device, dtype)
    return dict(transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(**tiny.SCHEDULER), vae=vae,
                text_encoder=text_encoder, tokenizer=tokenizer)


def build_random_z_image(out_dir: str | os.PathLike, seed: int = 0, *, n_layers: int = 30, text_layers: int = 2,
                         device: str | torch.device | None = None, overwrite: bool = False) -> Path:
    """Write the checkpoint to `out_dir` (bf16, diffusers layout) unless the same build is already there; the
    folder is written next to its destination and renamed into place."""
    from diffusers import ZImagePipeline

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    out = Path(out_dir).resolve()
    wanted = {"family": "z_image", "preset": PRESET, "seed": seed, "n_layers": n_layers, "text_layers": text_layers,
              "builder_version": BUILDER_VERSION}

    def save(staging: Path) -> None:
        components = random_components(seed, n_layers=n_layers, text_layers=text_layers, device=device)
        ZImagePipeline(**components).save_pretrained(staging, max_shard_size="5GB")

    return builds.write_build(out, wanted, save, overwrite=overwrite)
