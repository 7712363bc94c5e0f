"""Deterministic tiny random Qwen-Image checkpoints, built locally (no hub access exists on our machines).

The checkpoint has the real diffusers layout (`model_index.json`, `transformer/`, `vae/`, `text_encoder/`,
`tokenizer/`, `scheduler/`) in fp32, so diffusers' `QwenImagePipeline` and vllm-omni's Qwen-Image pipeline load it
like the real model. Same seed → identical tensors and tokenizer.

The prompt-template offset: both pipelines wrap a prompt in Qwen's chat template and drop the first
`prompt_template_encode_start_idx = 34` hidden states, the length of the system prefix under the real Qwen
tokenizer. Our tokenizer is a byte-level BPE trained here with Qwen2's pre-tokenizer on a corpus that contains the
template, so each word of the prefix is one token, as in the real vocabulary, and the prefix is exactly 34 tokens.
Neither pipeline needs patching; `template_prefix_tokens` lets tests (and the builder) check it.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from app.models.builds import (
    QWEN_IMAGE_TEMPLATE,
    QWEN_IMAGE_TEMPLATE_START_IDX,
    SPECIAL_TOKENS,
    train_tokenizer,
    write_build,
)

BUILDER_VERSION = 1  # bump when the architecture below changes, so cached checkpoints are rebuilt

# Architecture: every size the pipelines tie together, in one place.
TEXT_HIDDEN = 32  # == transformer joint_attention_dim == vision out_hidden_size
HEAD_DIM = 16  # == sum(axes_dims_rope); text heads: TEXT_HIDDEN / 2 → mrope sections sum to HEAD_DIM / 2
Z_DIM = 16  # vllm-omni's Qwen-Image expects 16 latent channels; packed 2x2 → in_channels 64


def template_prefix_tokens(tokenizer) -> int:
    """How many tokens the template's system prefix (everything before the prompt) takes under `tokenizer`."""
    prefix = QWEN_IMAGE_TEMPLATE.split("{}")[0]
    return len(tokenizer(prefix).input_ids)


def tiny_qwen_image_components(seed: int = 0) -> dict:
    """The five pipeline components, random but reproducible: same seed → identical tensors."""
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    tokenizer = train_tokenizer()
    prefix_len = template_prefix_tokens(tokenizer)
    if prefix_len != QWEN_IMAGE_TEMPLATE_START_IDX:
        raise RuntimeError(f"tiny tokenizer splits the template prefix into {prefix_len} tokens, "
                           f"not {QWEN_IMAGE_TEMPLATE_START_IDX}: prompt embeddings would be shifted")
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    with torch.random.fork_rng(devices=[]):  # the caller's RNG state is left alone
        torch.manual_seed(seed)
        text_config = dict(
            vocab_size=len(tokenizer), hidden_size=TEXT_HIDDEN, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=2048,
            bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"],
            rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0, "mrope_section": [2, 3, 3]},
        )
        text_encoder = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(
            text_config=text_config,
            vision_config=dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2,
                               out_hidden_size=TEXT_HIDDEN, fullatt_block_indexes=[0]),
            vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
            image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        )).eval()
        transformer = QwenImageTransformer2DModel(
            patch_size=2, in_channels=4 * Z_DIM, out_channels=Z_DIM, num_layers=2, attention_head_dim=HEAD_DIM,
            num_attention_heads=2, joint_attention_dim=TEXT_HIDDEN, axes_dims_rope=(4, 6, 6))
        vae = AutoencoderKLQwenImage(base_dim=8, z_dim=Z_DIM, dim_mult=[1, 2, 4, 4], num_res_blocks=1,
                                     temperal_downsample=[False, True, True])
    scheduler = FlowMatchEulerDiscreteScheduler(
        base_image_seq_len=256, base_shift=0.5, max_image_seq_len=8192, max_shift=0.9, shift=1.0,
        shift_terminal=0.02, use_dynamic_shifting=True, time_shift_type="exponential")
    return dict(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer)


def build_tiny_qwen_image(out_dir: str | os.PathLike, seed: int = 0, *, overwrite: bool = False) -> Path:
    """Write a tiny checkpoint to `out_dir` (fp32, diffusers layout) unless an identical build is already there.

    The folder is written next to its destination and renamed into place, so a reader never sees half a model.
    """
    def save(staging: Path) -> None:
        from diffusers import QwenImagePipeline  # only when building: the import is seconds of a job's start

        QwenImagePipeline(**tiny_qwen_image_components(seed)).save_pretrained(staging)

    out = Path(out_dir).resolve()
    wanted = {"family": "qwen_image", "seed": seed, "builder_version": BUILDER_VERSION}
    return write_build(out, wanted, save, overwrite=overwrite)
