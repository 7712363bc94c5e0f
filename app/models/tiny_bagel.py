"""Deterministic tiny random BAGEL checkpoints (the BAGEL-7B-MoT layout), built locally.

The folder has upstream BAGEL's files and tensor names, so our pure-torch model and vllm-omni's BAGEL pipeline
both load it like the real checkpoint:
- `config.json` (the top-level BAGEL config, with `llm_config`, `vit_config`, `vae_config` inside),
  `llm_config.json` (a Qwen2 config with `qk_norm`), `vit_config.json` (SigLIP), `preprocessor_config.json`;
- tokenizer files: the tiny byte-level BPE of `app.models.tiny` (Qwen2 tokenizer) plus `<|fim_middle|>`;
- `ema.safetensors`: the Mixture-of-Transformers LLM (every layer has an understanding expert, the plain names,
  and a generation expert, the `*_moe_gen` names), the timestep embedder, the latent connectors (`vae2llm`,
  `llm2vae`), the 2-D sin-cos position tables, the SigLIP ViT (`vit_model.vision_model.*`) and its connector;
- `ae.safetensors`: the FLUX-style autoencoder in its original (LDM) names: `encoder.down.N.block.M.*`, ...

vllm-omni always builds the full 84M-parameter autoencoder; ours is 4M parameters (`ch` 32, one residual block per
level), declared in `config.json` under `flowgrpo_tiny_ae`, which our engines read.

Norm weights are random around 1 (not all ones) and the two experts get different draws, so a test can tell the
understanding path from the generation path. Same seed → identical files.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import torch

from app.models.flux_ae import TINY_AE_KEY, diffusers_to_ldm_vae, flux_autoencoder
from app.models.tiny import SPECIAL_TOKENS, train_tokenizer, write_build

BUILDER_VERSION = 1
FIM_MIDDLE = "<|fim_middle|>"  # the edit-image placeholder of BAGEL's prompts

# LLM (Qwen2 with QK-norm, two experts per layer)
HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS = 64, 128, 2, 4, 2
HEAD_DIM = HIDDEN // HEADS
MAX_LATENT_SIZE = 8  # latent grid side (after the 2x2 patch): images up to 8·2·8 = 128 px
LATENT_CHANNELS, LATENT_PATCH = 16, 2  # a token is a 2x2 patch of 16 channels: 64 values
TIMESTEP_FREQS = 256  # sinusoidal timestep features in front of the timestep MLP
# SigLIP ViT
VIT_HIDDEN, VIT_MAX_PATCHES = 32, 16
VIT = dict(model_type="siglip_vision_model", hidden_size=VIT_HIDDEN, intermediate_size=64, num_hidden_layers=1,
           num_attention_heads=2, patch_size=14, image_size=224, num_channels=3)
# autoencoder (FLUX layout), tiny
TINY_AE = dict(resolution=256, in_channels=3, downsample=8, ch=32, out_ch=3, ch_mult=[1, 2, 4, 4],
               num_res_blocks=1, z_channels=LATENT_CHANNELS, scale_factor=0.3611, shift_factor=0.1159)


def build_tiny_bagel(out_dir: str | os.PathLike, seed: int = 0, *, overwrite: bool = False) -> Path:
    """Write a tiny BAGEL checkpoint to `out_dir` unless an identical build is already there."""
    out = Path(out_dir).resolve()
    wanted = {"family": "bagel", "seed": seed, "builder_version": BUILDER_VERSION}
    return write_build(out, wanted, lambda staging: _save(staging, seed), overwrite=overwrite)


def _save(folder: Path, seed: int) -> None:
    from safetensors.torch import save_file

    tokenizer = train_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": [*SPECIAL_TOKENS[1:], FIM_MIDDLE]})
    tokenizer.save_pretrained(folder)
    llm = dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_act="silu", hidden_size=HIDDEN,
               intermediate_size=INTERMEDIATE, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
               num_key_value_heads=KV_HEADS, max_position_embeddings=2048, rms_norm_eps=1e-6, rope_theta=1e6,
               vocab_size=len(tokenizer), bos_token_id=tokenizer.convert_tokens_to_ids("<|im_start|>"),
               eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"), tie_word_embeddings=False, qk_norm=True,
               torch_dtype="float32")
    config = dict(architectures=["BagelForConditionalGeneration"], model_type="bagel", visual_gen=True,
                  visual_und=True, llm_config=llm, vit_config=VIT,
                  vae_config={"z_channels": LATENT_CHANNELS, "downsample": 8}, latent_patch_size=LATENT_PATCH,
                  max_latent_size=MAX_LATENT_SIZE, vit_max_num_patch_per_side=VIT_MAX_PATCHES,
                  connector_act="gelu_pytorch_tanh", interpolate_pos=False, timestep_shift=3.0,
                  torch_dtype="float32", **{TINY_AE_KEY: TINY_AE})
    for name, content in (("config.json", config), ("llm_config.json", llm), ("vit_config.json", VIT),
                          ("preprocessor_config.json", _PREPROCESSOR)):
        (folder / name).write_text(json.dumps(content, indent=1) + "\n")
    generator = torch.Generator().manual_seed(seed)
    save_file(ema_tensors(len(tokenizer), generator, seed), str(folder / "ema.safetensors"))
    save_file(autoencoder_tensors(generator), str(folder / "ae.safetensors"))


_PREPROCESSOR = dict(do_convert_rgb=True, do_normalize=True, do_rescale=True, do_resize=True, image_mean=[0.5] * 3,
                     image_std=[0.5] * 3, image_processor_type="SiglipImageProcessor", rescale_factor=1 / 255,
                     resample=3, size={"height": 224, "width": 224})


def ema_tensors(vocab: int, generator: torch.Generator, seed: int) -> dict[str, torch.Tensor]:
    """Every tensor of `ema.safetensors` under its upstream name, random and reproducible."""

    def weight(*shape, scale=0.2):
        return torch.randn(*shape, generator=generator) * scale

    def norm(size):  # around 1, not 1: the experts' norms must differ to be told apart
        return 1 + 0.1 * torch.randn(size, generator=generator)

    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    out = {"language_model.model.embed_tokens.weight": weight(vocab, HIDDEN, scale=0.5),
           "language_model.lm_head.weight": weight(vocab, HIDDEN, scale=0.02)}
    for layer in range(LAYERS):
        prefix = f"language_model.model.layers.{layer}."
        for expert in ("", "_moe_gen"):
            out[f"{prefix}input_layernorm{expert}.weight"] = norm(HIDDEN)
            out[f"{prefix}post_attention_layernorm{expert}.weight"] = norm(HIDDEN)
            for proj, size in (("q", q), ("k", kv), ("v", kv)):
                out[f"{prefix}self_attn.{proj}_proj{expert}.weight"] = weight(size, HIDDEN)
                out[f"{prefix}self_attn.{proj}_proj{expert}.bias"] = weight(size, scale=0.02)
            out[f"{prefix}self_attn.o_proj{expert}.weight"] = weight(HIDDEN, q)
            out[f"{prefix}self_attn.q_norm{expert}.weight"] = norm(HEAD_DIM)
            out[f"{prefix}self_attn.k_norm{expert}.weight"] = norm(HEAD_DIM)
            mlp = "mlp_moe_gen" if expert else "mlp"
            out[f"{prefix}{mlp}.gate_proj.weight"] = weight(INTERMEDIATE, HIDDEN)
            out[f"{prefix}{mlp}.up_proj.weight"] = weight(INTERMEDIATE, HIDDEN)
            out[f"{prefix}{mlp}.down_proj.weight"] = weight(HIDDEN, INTERMEDIATE)
    out["language_model.model.norm.weight"] = norm(HIDDEN)
    out["language_model.model.norm_moe_gen.weight"] = norm(HIDDEN)
    token = LATENT_PATCH * LATENT_PATCH * LATENT_CHANNELS
    out.update({
        "time_embedder.mlp.0.weight": weight(HIDDEN, TIMESTEP_FREQS, scale=0.1),
        "time_embedder.mlp.0.bias": weight(HIDDEN, scale=0.02),
        "time_embedder.mlp.2.weight": weight(HIDDEN, HIDDEN), "time_embedder.mlp.2.bias": weight(HIDDEN, scale=0.02),
        "vae2llm.weight": weight(HIDDEN, token), "vae2llm.bias": weight(HIDDEN, scale=0.02),
        "llm2vae.weight": weight(token, HIDDEN), "llm2vae.bias": weight(token, scale=0.02),
        "connector.fc1.weight": weight(HIDDEN, VIT_HIDDEN), "connector.fc1.bias": weight(HIDDEN, scale=0.02),
        "connector.fc2.weight": weight(HIDDEN, HIDDEN), "connector.fc2.bias": weight(HIDDEN, scale=0.02),
        "latent_pos_embed.pos_embed": sincos_2d(HIDDEN, MAX_LATENT_SIZE),
        "vit_pos_embed.pos_embed": sincos_2d(HIDDEN, VIT_MAX_PATCHES),
    })
    out.update({f"vit_model.vision_model.{k}": v for k, v in _siglip_tensors(seed).items()})
    return {k: v.contiguous() for k, v in out.items()}


def sincos_2d(dim: int, grid: int) -> torch.Tensor:
    """BAGEL's fixed 2-D sin-cos position table [grid², dim]: half the channels encode the row, half the column
    (MAE's construction)."""
    rows, cols = np.meshgrid(np.arange(grid, dtype=np.float64), np.arange(grid, dtype=np.float64), indexing="ij")

    def one_axis(positions: np.ndarray, channels: int) -> np.ndarray:
        omega = 1.0 / 10000 ** (np.arange(channels // 2, dtype=np.float64) / (channels / 2.0))
        angles = np.outer(positions.reshape(-1), omega)
        return np.concatenate([np.sin(angles), np.cos(angles)], axis=1)

    # upstream passes the grid as (w, h) to the row/column halves: the first half varies along a row
    table = np.concatenate([one_axis(cols, dim // 2), one_axis(rows, dim // 2)], axis=1)
    return torch.from_numpy(table).float()


def _siglip_tensors(seed: int) -> dict[str, torch.Tensor]:
    from transformers import SiglipVisionConfig, SiglipVisionModel

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        vit = SiglipVisionModel(SiglipVisionConfig(**VIT, vision_use_head=False))
    vit = getattr(vit, "vision_model", vit)  # transformers 5 has no `.vision_model` wrapper any more
    return {k: v.detach().clone() for k, v in vit.state_dict().items()}


def autoencoder_tensors(generator: torch.Generator, params: dict = TINY_AE) -> dict[str, torch.Tensor]:
    """The FLUX autoencoder's tensors in their original names: a diffusers `AutoencoderKL` of that geometry,
    randomly initialised, renamed by `diffusers_to_ldm_vae`."""
    autoencoder = flux_autoencoder(params)
    with torch.no_grad():
        for name, p in autoencoder.named_parameters():
            if name.endswith("bias"):
                p.copy_(0.02 * torch.randn(p.shape, generator=generator))
            elif p.ndim == 1:  # GroupNorm scales
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=generator))
            else:
                fan_in = p[0].numel()
                p.copy_(torch.randn(p.shape, generator=generator) / fan_in ** 0.5)
    return diffusers_to_ldm_vae(autoencoder.state_dict())
