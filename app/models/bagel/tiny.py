"""Deterministic tiny random BAGEL checkpoints (the BAGEL-7B-MoT layout), built locally.

The folder has upstream BAGEL's files and tensor names, so our pure-torch model and vllm-omni's BAGEL pipeline
both load it like the real checkpoint:
- `config.json` (the top-level BAGEL config, with `llm_config`, `vit_config`, `vae_config` inside),
  `llm_config.json` (a Qwen2 config with `qk_norm`), `vit_config.json` (SigLIP), `preprocessor_config.json`;
- tokenizer files: the tiny byte-level BPE of `app.models.qwen_image.tiny` (Qwen2 tokenizer) plus `<|fim_middle|>`;
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
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from app.models.bagel.flux_ae import FLUX_AE, TINY_AE_KEY, diffusers_to_ldm_vae, flux_autoencoder
from app.models.builds import SPECIAL_TOKENS, train_tokenizer, write_build

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




@dataclass(frozen=True)
class BagelSize:
    """Every size of a random BAGEL checkpoint and how its weights are drawn; the defaults are the tiny one's
    (`app.models.bagel.real_width` sets BAGEL-7B-MoT's)."""

    hidden: int = HIDDEN
    intermediate: int = INTERMEDIATE
    layers: int = LAYERS
    heads: int = HEADS
    kv_heads: int = KV_HEADS
    max_latent_size: int = MAX_LATENT_SIZE
    vit: dict = field(default_factory=lambda: dict(VIT))  # the SigLIP config (vit_config.json)
    vit_max_patches: int = VIT_MAX_PATCHES
    vit_input_side: int = 224  # the side the SigLIP preprocessor resizes an edit's input to
    autoencoder: dict = field(default_factory=lambda: dict(TINY_AE))  # FLUX_AE: none declared in config.json
    vocab_size: int | None = None  # the embedding's rows; None: the tokenizer's length
    weight_std: float = 0.2  # std of the LLM's and connectors' matrices (a few have fixed scales of their own)
    dtype: str = "float32"  # of ema.safetensors

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def describe(self) -> dict:
        return asdict(self)


def build_tiny_bagel(out_dir: str | os.PathLike, seed: int = 0, *, overwrite: bool = False) -> Path:
    """Write a tiny BAGEL checkpoint to `out_dir` unless an identical build is already there."""
    out = Path(out_dir).resolve()
    wanted = {"family": "bagel", "seed": seed, "builder_version": BUILDER_VERSION}
    return write_build(out, wanted, lambda staging: save_bagel(staging, seed), overwrite=overwrite)


def build_tiny_bagel_full_ae(out_dir: str | os.PathLike, seed: int = 0, *, overwrite: bool = False) -> Path:
    """The tiny BAGEL with the real checkpoint's autoencoder (`FLUX_AE`, 84M parameters, none declared in
    config.json): what vllm-omni's thinker stage loads. Its AR model builds the autoencoder's encoder at the real
    geometry (vllm-omni's `default_ae_params`) whatever config.json declares, so the tiny one's tensors do not fit."""
    out = Path(out_dir).resolve()
    wanted = {"family": "bagel", "preset": "tiny-bagel-full-ae", "seed": seed, "builder_version": BUILDER_VERSION}
    size = BagelSize(autoencoder=dict(FLUX_AE))
    return write_build(out, wanted, lambda staging: save_bagel(staging, seed, size), overwrite=overwrite)


def save_bagel(folder: Path, seed: int, size: BagelSize = BagelSize(), device: str | torch.device = "cpu") -> None:
    """Write a random BAGEL checkpoint of `size` into `folder`; the weights are drawn by one generator seeded with
    `seed` on `device` (the same seed and device type give identical files)."""
    from safetensors.torch import save_file

    tokenizer = train_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": [*SPECIAL_TOKENS[1:], FIM_MIDDLE]})
    tokenizer.save_pretrained(folder)
    vocab = size.vocab_size or len(tokenizer)
    llm = dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_act="silu", hidden_size=size.hidden,
               intermediate_size=size.intermediate, num_hidden_layers=size.layers, num_attention_heads=size.heads,
               num_key_value_heads=size.kv_heads, max_position_embeddings=2048, rms_norm_eps=1e-6, rope_theta=1e6,
               vocab_size=vocab, bos_token_id=tokenizer.convert_tokens_to_ids("<|im_start|>"),
               eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"), tie_word_embeddings=False, qk_norm=True,
               torch_dtype=size.dtype)
    declared_ae = {} if size.autoencoder == FLUX_AE else {TINY_AE_KEY: size.autoencoder}
    config = dict(architectures=["BagelForConditionalGeneration"], model_type="bagel", visual_gen=True,
                  visual_und=True, llm_config=llm, vit_config=size.vit,
                  vae_config={"z_channels": LATENT_CHANNELS, "downsample": 8}, latent_patch_size=LATENT_PATCH,
                  max_latent_size=size.max_latent_size, vit_max_num_patch_per_side=size.vit_max_patches,
                  connector_act="gelu_pytorch_tanh", interpolate_pos=False, timestep_shift=3.0,
                  torch_dtype=size.dtype, **declared_ae)
    preprocessor = dict(_PREPROCESSOR, size={"height": size.vit_input_side, "width": size.vit_input_side})
    for name, content in (("config.json", config), ("llm_config.json", llm), ("vit_config.json", size.vit),
                          ("preprocessor_config.json", preprocessor)):
        (folder / name).write_text(json.dumps(content, indent=1) + "\n")
    generator = torch.Generator(device).manual_seed(seed)
    save_file(_on_cpu(ema_tensors(vocab, generator, seed, size)), str(folder / "ema.safetensors"))
    save_file(_on_cpu(autoencoder_tensors(generator, size.autoencoder)), str(folder / "ae.safetensors"))


def _on_cpu(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.to("cpu").contiguous() for k, v in tensors.items()}


_PREPROCESSOR = dict(do_convert_rgb=True, do_normalize=True, do_rescale=True, do_resize=True, image_mean=[0.5] * 3,
                     image_std=[0.5] * 3, image_processor_type="SiglipImageProcessor", rescale_factor=1 / 255,
                     resample=3, size={"height": 224, "width": 224})


def ema_tensors(vocab: int, generator: torch.Generator, seed: int,
                size: BagelSize = BagelSize()) -> dict[str, torch.Tensor]:
    """Every tensor of `ema.safetensors` under its upstream name, random and reproducible; drawn where `generator`
    lives and kept there, in `size.dtype`."""
    dtype = getattr(torch, size.dtype)

    def weight(*shape, scale=None):
        scale = size.weight_std if scale is None else scale
        return (torch.randn(*shape, generator=generator, device=generator.device) * scale).to(dtype)

    def norm(width):  # around 1, not 1: the experts' norms must differ to be told apart
        return (1 + 0.1 * torch.randn(width, generator=generator, device=generator.device)).to(dtype)

    hidden, head_dim = size.hidden, size.head_dim
    q, kv = size.heads * head_dim, size.kv_heads * head_dim
    out = {"language_model.model.embed_tokens.weight": weight(vocab, hidden, scale=0.5),
           "language_model.lm_head.weight": weight(vocab, hidden, scale=0.02)}
    for layer in range(size.layers):
        prefix = f"language_model.model.layers.{layer}."
        for expert in ("", "_moe_gen"):
            out[f"{prefix}input_layernorm{expert}.weight"] = norm(hidden)
            out[f"{prefix}post_attention_layernorm{expert}.weight"] = norm(hidden)
            for proj, rows in (("q", q), ("k", kv), ("v", kv)):
                out[f"{prefix}self_attn.{proj}_proj{expert}.weight"] = weight(rows, hidden)
                out[f"{prefix}self_attn.{proj}_proj{expert}.bias"] = weight(rows, scale=0.02)
            out[f"{prefix}self_attn.o_proj{expert}.weight"] = weight(hidden, q)
            out[f"{prefix}self_attn.q_norm{expert}.weight"] = norm(head_dim)
            out[f"{prefix}self_attn.k_norm{expert}.weight"] = norm(head_dim)
            mlp = "mlp_moe_gen" if expert else "mlp"
            out[f"{prefix}{mlp}.gate_proj.weight"] = weight(size.intermediate, hidden)
            out[f"{prefix}{mlp}.up_proj.weight"] = weight(size.intermediate, hidden)
            out[f"{prefix}{mlp}.down_proj.weight"] = weight(hidden, size.intermediate)
    out["language_model.model.norm.weight"] = norm(hidden)
    out["language_model.model.norm_moe_gen.weight"] = norm(hidden)
    token = LATENT_PATCH * LATENT_PATCH * LATENT_CHANNELS
    out.update({
        "time_embedder.mlp.0.weight": weight(hidden, TIMESTEP_FREQS, scale=0.1),
        "time_embedder.mlp.0.bias": weight(hidden, scale=0.02),
        "time_embedder.mlp.2.weight": weight(hidden, hidden), "time_embedder.mlp.2.bias": weight(hidden, scale=0.02),
        "vae2llm.weight": weight(hidden, token), "vae2llm.bias": weight(hidden, scale=0.02),
        "llm2vae.weight": weight(token, hidden), "llm2vae.bias": weight(token, scale=0.02),
        "connector.fc1.weight": weight(hidden, size.vit["hidden_size"]),
        "connector.fc1.bias": weight(hidden, scale=0.02),
        "connector.fc2.weight": weight(hidden, hidden), "connector.fc2.bias": weight(hidden, scale=0.02),
        "latent_pos_embed.pos_embed": sincos_2d(hidden, size.max_latent_size).to(dtype),
        "vit_pos_embed.pos_embed": sincos_2d(hidden, size.vit_max_patches).to(dtype),
    })
    out.update({f"vit_model.vision_model.{k}": v.to(dtype) for k, v in _siglip_tensors(seed, size.vit).items()})
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


def _siglip_tensors(seed: int, config: dict) -> dict[str, torch.Tensor]:
    """The ViT's tensors: transformers' own initialisation of SigLIP, seeded (on the CPU)."""
    from transformers import SiglipVisionConfig, SiglipVisionModel

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        vit = SiglipVisionModel(SiglipVisionConfig(**config, vision_use_head=False))
    vit = getattr(vit, "vision_model", vit)  # transformers 5 has no `.vision_model` wrapper any more
    return {k: v.detach().clone() for k, v in vit.state_dict().items()}


def autoencoder_tensors(generator: torch.Generator, params: dict = TINY_AE) -> dict[str, torch.Tensor]:
    """The FLUX autoencoder's tensors in their original names: a diffusers `AutoencoderKL` of that geometry,
    randomly initialised, renamed by `diffusers_to_ldm_vae`."""
    autoencoder = flux_autoencoder(params)

    def randn(shape):  # drawn where the generator lives
        return torch.randn(shape, generator=generator, device=generator.device)

    with torch.no_grad():
        for name, p in autoencoder.named_parameters():
            if name.endswith("bias"):
                p.copy_(0.02 * randn(p.shape))
            elif p.ndim == 1:  # GroupNorm scales
                p.copy_(1 + 0.1 * randn(p.shape))
            else:
                fan_in = p[0].numel()
                p.copy_(randn(p.shape) / fan_in ** 0.5)
    return diffusers_to_ldm_vae(autoencoder.state_dict())
