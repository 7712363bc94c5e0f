"""Random Qwen-Image checkpoints at the real size, built locally (no hub access exists on our machines).

The transformer is Qwen-Image's own (60 MMDiT blocks, 24 heads of 128 = 3072 wide, 20.4B parameters) and so is
the VAE; the text encoder has the real width (3584, the transformer's `joint_attention_dim`) but only a few
layers, since prompt encoding is a tiny share of the work; the tokenizer is the tiny one
(app/models/builds.py).
Weights are bf16, drawn from N(0, 0.02) per matrix (norm scales 1, biases 0) with one seeded generator on the build
device: same seed and device type, identical tensors. The transformer is made on the meta device and materialised
straight on the GPU, so the build never holds 80 GB of fp32 on the CPU.

What it is for: throughput and memory measurements, and the GPU tests, through the normal `model.path` route
(a diffusers-layout folder, loaded as a user's real checkpoint would be). It generates noise, not pictures.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from app.models import builds
from app.models.qwen_image import tiny

PRESET = "qwen-image-full"
BUILDER_VERSION = 1
TRANSFORMER = dict(patch_size=2, in_channels=64, out_channels=16, num_layers=60, attention_head_dim=128,
                   num_attention_heads=24, joint_attention_dim=3584, axes_dims_rope=(16, 56, 56))
TEXT = dict(hidden_size=3584, intermediate_size=18944, num_attention_heads=28, num_key_value_heads=4,
            rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0, "mrope_section": [16, 24, 24]})


def full_random_components(seed: int = 0, *, num_layers: int = 60, text_layers: int = 2,
                           device: str | torch.device = "cuda", dtype: torch.dtype = torch.bfloat16) -> dict:
    """The five pipeline components; `num_layers` < 60 gives a shallower transformer of the real width (tests)."""
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel
    from diffusers.models.transformers.transformer_qwenimage import QwenEmbedRope
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    tokenizer = builds.train_tokenizer()
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in tiny.SPECIAL_TOKENS}
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.device("meta"):
        transformer = QwenImageTransformer2DModel(**{**TRANSFORMER, "num_layers": num_layers})
    transformer = transformer.to_empty(device=device).to(dtype)
    # the rotary tables are plain attributes computed in __init__: made on the meta device above, so again here
    transformer.pos_embed = QwenEmbedRope(theta=10000, axes_dim=list(TRANSFORMER["axes_dims_rope"]), scale_rope=True)
    builds.randomise(transformer, generator)
    text_config = dict(
        TEXT, vocab_size=len(tokenizer), num_hidden_layers=text_layers, max_position_embeddings=128_000,
        bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"])
    with torch.device(device):
        text_encoder = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(
            text_config=text_config,
            vision_config=dict(depth=1, hidden_size=64, intermediate_size=64, num_heads=2,
                               out_hidden_size=TEXT["hidden_size"], fullatt_block_indexes=[0]),
            vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
            image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        )).to(dtype).eval()
    builds.randomise(text_encoder, generator)
    with torch.random.fork_rng(devices=[]):  # the VAE keeps diffusers' own init (0.13B parameters), seeded
        torch.manual_seed(seed)
        vae = AutoencoderKLQwenImage().to(device, dtype)  # the class defaults are Qwen-Image's VAE
    scheduler = FlowMatchEulerDiscreteScheduler(
        base_image_seq_len=256, base_shift=0.5, max_image_seq_len=8192, max_shift=0.9, shift=1.0,
        shift_terminal=0.02, use_dynamic_shifting=True, time_shift_type="exponential")
    return dict(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer)


def build_full_random_qwen_image(out_dir: str | os.PathLike, seed: int = 0, *, num_layers: int = 60,
                                 text_layers: int = 2, device: str | torch.device | None = None,
                                 overwrite: bool = False) -> Path:
    """Write the checkpoint to `out_dir` (bf16, diffusers layout) unless the same build is already there; the
    folder is written next to its destination and renamed into place."""
    from diffusers import QwenImagePipeline

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    out = Path(out_dir).resolve()
    wanted = {"family": "qwen_image", "preset": PRESET, "seed": seed, "num_layers": num_layers,
              "text_layers": text_layers, "builder_version": BUILDER_VERSION}

    def save(staging: Path) -> None:
        components = full_random_components(seed, num_layers=num_layers, text_layers=text_layers, device=device)
        QwenImagePipeline(**components).save_pretrained(staging, max_shard_size="5GB")

    return builds.write_build(out, wanted, save, overwrite=overwrite)
