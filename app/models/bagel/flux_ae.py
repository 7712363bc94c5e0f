"""BAGEL's autoencoder: the FLUX VAE (16 latent channels, 8x down), as a diffusers `AutoencoderKL`.

The checkpoint (`ae.safetensors`) keeps the original LDM/FLUX tensor names; diffusers' own converter
(`convert_ldm_vae_checkpoint`) maps them on load, and `diffusers_to_ldm_vae` is its inverse (the tiny builder
writes through it). `encode` / `decode` apply BAGEL's latent scale and shift: z = scale·(mean − shift).
"""

from __future__ import annotations

import os
import re

import torch

# the real checkpoint's geometry (vllm-omni's `default_ae_params`); a tiny checkpoint declares its own in
# config.json under `flowgrpo_tiny_ae`
FLUX_AE = dict(resolution=256, in_channels=3, downsample=8, ch=128, out_ch=3, ch_mult=[1, 2, 4, 4],
               num_res_blocks=2, z_channels=16, scale_factor=0.3611, shift_factor=0.1159)
TINY_AE_KEY = "flowgrpo_tiny_ae"


def autoencoder_params(config: dict) -> dict:
    """The autoencoder geometry of a BAGEL checkpoint's config.json."""
    return dict(config.get(TINY_AE_KEY) or FLUX_AE)


def flux_autoencoder(params: dict = FLUX_AE):
    """A diffusers `AutoencoderKL` with the FLUX/BAGEL autoencoder's geometry (the FLUX VAE in diffusers)."""
    from diffusers import AutoencoderKL

    levels = len(params["ch_mult"])
    return AutoencoderKL(
        in_channels=params["in_channels"], out_channels=params["out_ch"], latent_channels=params["z_channels"],
        down_block_types=["DownEncoderBlock2D"] * levels, up_block_types=["UpDecoderBlock2D"] * levels,
        block_out_channels=[params["ch"] * m for m in params["ch_mult"]], layers_per_block=params["num_res_blocks"],
        norm_num_groups=32, sample_size=params["resolution"], scaling_factor=params["scale_factor"],
        shift_factor=params["shift_factor"], use_quant_conv=False, use_post_quant_conv=False)


_LDM_RENAMES = [  # diffusers name pattern → original (LDM/FLUX) name; {n} is the decoder level count
    (r"^encoder\.down_blocks\.(\d+)\.resnets\.(\d+)\.", r"encoder.down.\1.block.\2."),
    (r"^encoder\.down_blocks\.(\d+)\.downsamplers\.0\.", r"encoder.down.\1.downsample."),
    (r"^(encoder|decoder)\.mid_block\.resnets\.0\.", r"\1.mid.block_1."),
    (r"^(encoder|decoder)\.mid_block\.resnets\.1\.", r"\1.mid.block_2."),
    (r"^(encoder|decoder)\.mid_block\.attentions\.0\.group_norm\.", r"\1.mid.attn_1.norm."),
    (r"^(encoder|decoder)\.mid_block\.attentions\.0\.to_(q|k|v)\.", r"\1.mid.attn_1.\2."),
    (r"^(encoder|decoder)\.mid_block\.attentions\.0\.to_out\.0\.", r"\1.mid.attn_1.proj_out."),
    (r"^(encoder|decoder)\.conv_norm_out\.", r"\1.norm_out."),
    (r"\.conv_shortcut\.", ".nin_shortcut."),
]


def diffusers_to_ldm_vae(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A diffusers `AutoencoderKL` state dict in the original LDM/FLUX names (the inverse of diffusers'
    `convert_ldm_vae_checkpoint`): decoder levels are numbered from the bottom, attention projections are 1x1
    convolutions."""
    levels = 1 + max(int(m.group(1)) for k in state if (m := re.match(r"decoder\.up_blocks\.(\d+)\.", k)))
    out = {}
    for key, tensor in state.items():
        name = key
        if m := re.match(r"^decoder\.up_blocks\.(\d+)\.(resnets\.(\d+)|upsamplers\.0)\.", key):
            level = levels - 1 - int(m.group(1))
            inner = f"block.{m.group(3)}." if m.group(3) is not None else "upsample."
            name = f"decoder.up.{level}.{inner}" + key[m.end():]
        for pattern, replacement in _LDM_RENAMES:
            name = re.sub(pattern, replacement, name)
        if ".mid.attn_1." in name and name.endswith("weight") and tensor.ndim == 2:
            tensor = tensor[:, :, None, None]
        out[name] = tensor.contiguous()
    return out


def load_flux_autoencoder(path: str | os.PathLike, params: dict, dtype: torch.dtype = torch.float32):
    """`ae.safetensors` (original names) into a diffusers `AutoencoderKL` via diffusers' own converter; strict."""
    from diffusers.loaders.single_file_utils import convert_ldm_vae_checkpoint
    from safetensors.torch import load_file

    autoencoder = flux_autoencoder(params)
    converted = convert_ldm_vae_checkpoint(load_file(str(path)), autoencoder.config)
    autoencoder.load_state_dict(converted, strict=True)
    return (autoencoder if dtype == torch.float32 else autoencoder.to(dtype)).eval()


@torch.no_grad()
def encode(autoencoder, images: torch.Tensor, params: dict) -> torch.Tensor:
    """Images [B, 3, H, W] in [-1, 1] → BAGEL latents [B, z, H/8, W/8]: the posterior mean, scaled and shifted
    (upstream samples from the posterior; the mean makes an edit's conditioning a function of its image)."""
    mean = autoencoder.encode(images.to(autoencoder.dtype)).latent_dist.mode()
    return params["scale_factor"] * (mean - params["shift_factor"])


@torch.no_grad()
def decode(autoencoder, latents: torch.Tensor, params: dict) -> torch.Tensor:
    """BAGEL latents [B, z, h, w] → uint8 images [B, H, W, 3] (rounded down after clamping, as vllm-omni does)."""
    z = latents.to(autoencoder.dtype) / params["scale_factor"] + params["shift_factor"]
    image = autoencoder.decode(z).sample
    return ((image.float() * 0.5 + 0.5).clamp(0, 1) * 255).to(torch.uint8).permute(0, 2, 3, 1).cpu()
