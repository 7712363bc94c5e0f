"""Random FLUX.1-dev checkpoints at the real size, built locally (no hub access exists on our machines).

The transformer is FLUX.1-dev's own, from its published config: 19 double-stream and 38 single-stream blocks of 24
heads of 128 (3072 wide), T5 states 4096 wide, CLIP's pooled 768, the guidance embedding, 11.9B parameters; so is
the VAE (16 latent channels, FLUX's scaling and shift) and the scheduler (shifted by image size). The text encoders
have their real widths (CLIP-L 768, T5-XXL 4096 with its 10240-wide gated MLP) but only `text_layers` layers each,
since prompt encoding is a small share of the work; the tokenizers are the tiny ones (app/models/sd3/tiny.py).
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
from app.models.flux import tiny

PRESET = "flux1-dev"
BUILDER_VERSION = 1
TRANSFORMER = dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
                   num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
                   axes_dims_rope=(16, 56, 56))
CLIP_L = dict(hidden_size=768, intermediate_size=3072, num_attention_heads=12, projection_dim=768,
              hidden_act="quick_gelu")
T5_XXL = dict(d_model=4096, d_kv=64, d_ff=10240, num_heads=64, feed_forward_proj="gated-gelu")
VAE = dict(in_channels=3, out_channels=3, latent_channels=16, block_out_channels=(128, 256, 512, 512),
           down_block_types=["DownEncoderBlock2D"] * 4, up_block_types=["UpDecoderBlock2D"] * 4, layers_per_block=2,
           norm_num_groups=32, sample_size=1024, scaling_factor=tiny.VAE_SCALING, shift_factor=tiny.VAE_SHIFT,
           use_quant_conv=False, use_post_quant_conv=False)


def random_components(seed: int = 0, *, num_single_layers: int = 38, text_layers: int = 2,
                      device: str | torch.device = "cuda", dtype: torch.dtype = torch.bfloat16) -> dict:
    """The seven pipeline components; fewer single blocks give a shallower transformer of the real width (19
    double blocks then a share of the 38 single ones, as the real model's proportions go)."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    from app.models.sd3.tiny import CLIP_MAX_LENGTH, CLIP_SPECIALS, train_clip_tokenizer, train_t5_tokenizer

    clip_tokenizer, t5_tokenizer = train_clip_tokenizer(), train_t5_tokenizer()
    bos, eos = (clip_tokenizer.convert_tokens_to_ids(t) for t in CLIP_SPECIALS)
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.device("meta"):
        transformer = FluxTransformer2DModel(**{**TRANSFORMER, "num_single_layers": num_single_layers})
    transformer = transformer.to_empty(device=device).to(dtype)
    builds.randomise(transformer, generator)
    with torch.device(device):
        clip = CLIPTextModel(CLIPTextConfig(vocab_size=len(clip_tokenizer), num_hidden_layers=text_layers,
                                            max_position_embeddings=CLIP_MAX_LENGTH, bos_token_id=bos,
                                            eos_token_id=eos, pad_token_id=eos, **CLIP_L)).to(dtype).eval()
        t5 = T5EncoderModel(T5Config(vocab_size=len(t5_tokenizer), num_layers=text_layers,
                                     pad_token_id=t5_tokenizer.pad_token_id, eos_token_id=t5_tokenizer.eos_token_id,
                                     decoder_start_token_id=t5_tokenizer.pad_token_id, **T5_XXL)).to(dtype).eval()
    for encoder in (clip, t5):
        builds.randomise(encoder, generator)
    with torch.random.fork_rng(devices=[]):  # the VAE keeps diffusers' own init (84M parameters), seeded
        torch.manual_seed(seed)
        vae = AutoencoderKL(**VAE).to(device, dtype)
    return dict(transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(**tiny.SCHEDULER), vae=vae,
                text_encoder=clip, tokenizer=clip_tokenizer, text_encoder_2=t5, tokenizer_2=t5_tokenizer)


def build_random_flux1_dev(out_dir: str | os.PathLike, seed: int = 0, *, num_single_layers: int = 38,
                           text_layers: int = 2, device: str | torch.device | None = None,
                           overwrite: bool = False) -> Path:
    """Write the checkpoint to `out_dir` (bf16, diffusers layout) unless the same build is already there; the
    folder is written next to its destination and renamed into place."""
    from diffusers import FluxPipeline

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    out = Path(out_dir).resolve()
    wanted = {"family": "flux", "preset": PRESET, "seed": seed, "num_single_layers": num_single_layers,
              "text_layers": text_layers, "builder_version": BUILDER_VERSION}

    def save(staging: Path) -> None:
        components = random_components(seed, num_single_layers=num_single_layers, text_layers=text_layers,
                                       device=device)
        FluxPipeline(**components).save_pretrained(staging, max_shard_size="5GB")

    return builds.write_build(out, wanted, save, overwrite=overwrite)
