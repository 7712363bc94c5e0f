"""Random BAGEL checkpoints at BAGEL-7B-MoT's real layer width, built locally (no hub access exists on our machines).

The files and tensor names are the tiny builder's (`app.models.bagel.tiny.save_bagel`, upstream BAGEL's layout), at
the real sizes:
- the Mixture-of-Transformers LLM of Qwen2.5-7B's width: hidden 3584, MLP 18944, 28 query heads and 4 key/value
  heads of 128, both experts in every layer, but only a few of the 28 layers (`layers`, default 4);
- the embedding and LM head at the real vocabulary size, 152064 rows, though the tokenizer is the tiny one
  (`app.models.builds`, ~1k tokens; it only indexes the first rows): a real tokenizer cannot be built here, and the
  unused rows keep the memory of the weights what BAGEL's are (2 x 1.1 GB in bf16);
- latent grids up to 64 x 64 tokens (`max_latent_size` 64: 1024 px; 512 px images use the table's top-left
  corner), 16-channel latents in 2 x 2 patches;
- SigLIP at so400m's width (1152 wide, MLP 4304, 16 heads, 14 px patches, a 980 px / 70 x 70 patch position table,
  as BAGEL's ViT) with 2 of its 26 layers; the preprocessor resizes an edit's input to 518 x 518 (37 x 37 patches),
  which is what upstream's ViT transform (long side ≤ 980, short ≥ 224, multiples of 14) makes of a 512 px image;
- the real FLUX autoencoder (`flux_ae.FLUX_AE`: 128 base channels, 2 residual blocks per level, 84M parameters),
  so config.json declares no tiny one.

Weights: the LLM's and connectors' matrices N(0, 0.02) (Qwen2's initializer range; activations stay O(1) at this
width), norm scales around 1, the autoencoder scaled by its fan-in, SigLIP transformers' own seeded init;
`ema.safetensors` in bf16 (what the GPU engine and trainer load), `ae.safetensors` in fp32. The LLM and the
autoencoder are drawn on `device` by one seeded generator (same seed and device type: identical files); on a GPU
the 4-layer build takes seconds. What it is for: memory, speed and bf16 rollout/trainer parity at the real width
(`tests/train/test_bagel_real_width_gpu.py`). It generates noise, not pictures.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from app.models.bagel.flux_ae import FLUX_AE
from app.models.bagel.tiny import BagelSize, save_bagel
from app.models.builds import write_build

PRESET = "bagel-real-width"
BUILDER_VERSION = 1
VOCAB = 152064  # BAGEL-7B-MoT's (Qwen2.5's) embedding rows
SIGLIP_SO400M = dict(model_type="siglip_vision_model", hidden_size=1152, intermediate_size=4304, num_hidden_layers=2,
                     num_attention_heads=16, patch_size=14, image_size=980, num_channels=3)


def real_width_size(layers: int = 4, **changes) -> BagelSize:
    """BAGEL-7B-MoT's sizes with `layers` decoder layers; `changes` override fields (a narrow copy for CPU checks)."""
    fields = dict(hidden=3584, intermediate=18944, layers=layers, heads=28, kv_heads=4, max_latent_size=64,
                  vit=dict(SIGLIP_SO400M), vit_max_patches=70, vit_input_side=518, autoencoder=dict(FLUX_AE),
                  vocab_size=VOCAB, weight_std=0.02, dtype="bfloat16")
    return BagelSize(**{**fields, **changes})


def build_real_width_bagel(out_dir: str | os.PathLike, seed: int = 0, *, layers: int = 4,
                           size: BagelSize | None = None, device: str | torch.device | None = None,
                           overwrite: bool = False) -> Path:
    """Write the checkpoint to `out_dir` unless the same build is already there (`size`: another than
    `real_width_size(layers)`; `device`: where the weights are drawn, the GPU when there is one)."""
    size = size or real_width_size(layers)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    out = Path(out_dir).resolve()
    wanted = {"family": "bagel", "preset": PRESET, "seed": seed, "size": size.describe(),
              "device_type": torch.device(device).type, "builder_version": BUILDER_VERSION}
    return write_build(out, wanted, lambda staging: save_bagel(staging, seed, size, device), overwrite=overwrite)
