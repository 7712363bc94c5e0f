"""Random Stable Diffusion 3.5 Medium checkpoints at the real size, built locally (no hub access exists on our
machines).

The transformer is SD3.5-Medium's own, from its published config: 24 MMDiT blocks, 24 heads of 64 (1536 wide),
dual attention in blocks 0-12, RMS-normed queries and keys, text states 4096 wide, pooled 2048, 2.24B parameters
(2.47B with its position table); so
is the VAE (16 latent channels, SD3.5's scaling and shift). The three text encoders have their real widths (CLIP-L
768, CLIP-G 1280, T5-XXL 4096 with its 10240-wide gated MLP) but only `text_layers` layers each, since prompt
encoding is a small share of the work; the tokenizers are the tiny ones (app/models/sd3/tiny.py).
Weights are bf16, drawn from N(0, 0.02) per matrix (norm scales 1, biases 0: `builds.randomise`) by one seeded
generator on the build device; the transformer is made on the meta device and materialised straight on it.

What it is for: throughput and memory measurements through the normal `model.path` route (a diffusers-layout
folder, loaded as a user's real checkpoint would be). It generates noise, not pictures.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from app.models import builds
from app.models.sd3 import tiny

PRESET = "sd35-medium"
BUILDER_VERSION = 1
TRANSFORMER = dict(sample_size=128, patch_size=2, in_channels=16, out_channels=16, num_layers=24,
                   attention_head_dim=64, num_attention_heads=24, joint_attention_dim=4096,
                   caption_projection_dim=1536, pooled_projection_dim=2048, pos_embed_max_size=384,
                   qk_norm="rms_norm", dual_attention_layers=tuple(range(13)))
CLIP_L = dict(hidden_size=768, intermediate_size=3072, num_attention_heads=12, projection_dim=768,
              hidden_act="quick_gelu")
CLIP_G = dict(hidden_size=1280, intermediate_size=5120, num_attention_heads=20, projection_dim=1280,
              hidden_act="gelu")
T5_XXL = dict(d_model=4096, d_kv=64, d_ff=10240, num_heads=64, feed_forward_proj="gated-gelu")
VAE = dict(in_channels=3, out_channels=3, latent_channels=16, block_out_channels=(128, 256, 512, 512),
           down_block_types=["DownEncoderBlock2D"] * 4, up_block_types=["UpDecoderBlock2D"] * 4, layers_per_block=2,
           norm_num_groups=32, sample_size=1024, scaling_factor=tiny.VAE_SCALING, shift_factor=tiny.VAE_SHIFT,
           use_quant_conv=False, use_post_quant_conv=False)


def random_components(seed: int = 0, *, num_layers: int = 24, text_layers: int = 2,
                      device: str | torch.device = "cuda", dtype: torch.dtype = torch.bfloat16) -> dict:
    """The nine pipeline components; `num_layers` < 24 gives a shallower transformer of the real width (tests)."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel
    from diffusers.models.embeddings import PatchEmbed
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel

    clip_tokenizer, t5_tokenizer = tiny.train_clip_tokenizer(), tiny.train_t5_tokenizer()
    bos, eos = (clip_tokenizer.convert_tokens_to_ids(t) for t in tiny.CLIP_SPECIALS)
    generator = torch.Generator(device=device).manual_seed(seed)
    config = {**TRANSFORMER, "num_layers": num_layers,
              "dual_attention_layers": tuple(i for i in TRANSFORMER["dual_attention_layers"] if i < num_layers)}
    with torch.device("meta"):
        transformer = SD3Transformer2DModel(**config)
    transformer = transformer.to_empty(device=device)
    with torch.device(device):  # its sin-cos position table is a buffer computed in __init__: made again here
        transformer.pos_embed = PatchEmbed(height=config["sample_size"], width=config["sample_size"],
                                           patch_size=config["patch_size"], in_channels=config["in_channels"],
                                           embed_dim=config["num_attention_heads"] * config["attention_head_dim"],
                                           pos_embed_max_size=config["pos_embed_max_size"])
    transformer = transformer.to(dtype)
    builds.randomise(transformer, generator)
    encoders = []
    for width in (CLIP_L, CLIP_G):
        clip = CLIPTextConfig(vocab_size=len(clip_tokenizer), num_hidden_layers=text_layers,
                              max_position_embeddings=tiny.CLIP_MAX_LENGTH, bos_token_id=bos, eos_token_id=eos,
                              pad_token_id=eos, **width)
        with torch.device(device):
            encoders.append(CLIPTextModelWithProjection(clip).to(dtype).eval())
    with torch.device(device):
        encoders.append(T5EncoderModel(T5Config(
            vocab_size=len(t5_tokenizer), num_layers=text_layers, pad_token_id=t5_tokenizer.pad_token_id,
            eos_token_id=t5_tokenizer.eos_token_id, decoder_start_token_id=t5_tokenizer.pad_token_id, **T5_XXL,
        )).to(dtype).eval())
    for encoder in encoders:
        builds.randomise(encoder, generator)
    with torch.random.fork_rng(devices=[]):  # the VAE keeps diffusers' own init (84M parameters), seeded
        torch.manual_seed(seed)
        vae = AutoencoderKL(**VAE).to(device, dtype)
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)
    return dict(transformer=transformer, scheduler=scheduler, vae=vae, text_encoder=encoders[0],
                tokenizer=clip_tokenizer, text_encoder_2=encoders[1], tokenizer_2=clip_tokenizer,
                text_encoder_3=encoders[2], tokenizer_3=t5_tokenizer)


def build_random_sd35_medium(out_dir: str | os.PathLike, seed: int = 0, *, num_layers: int = 24,
                             text_layers: int = 2, device: str | torch.device | None = None,
                             overwrite: bool = False) -> Path:
    """Write the checkpoint to `out_dir` (bf16, diffusers layout) unless the same build is already there; the
    folder is written next to its destination and renamed into place."""
    from diffusers import StableDiffusion3Pipeline

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    out = Path(out_dir).resolve()
    wanted = {"family": "sd3", "preset": PRESET, "seed": seed, "num_layers": num_layers, "text_layers": text_layers,
              "builder_version": BUILDER_VERSION}

    def save(staging: Path) -> None:
        components = random_components(seed, num_layers=num_layers, text_layers=text_layers, device=device)
        StableDiffusion3Pipeline(**components).save_pretrained(staging, max_shard_size="5GB")

    return builds.write_build(out, wanted, save, overwrite=overwrite)
