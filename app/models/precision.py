"""fp32 means fp32 on CUDA too. PyTorch lets cuDNN run fp32 convolutions in TF32 by default
(`torch.backends.cudnn.allow_tf32`: 10 mantissa bits), so an fp32 model whose patch embedding is a convolution (SD3's)
drew latents on a GPU that the same model in fp32 elsewhere does not reproduce. Every process that runs a denoiser in
fp32 (the tiny checkpoints, the parity oracles, an fp32 run) turns TF32 off; bf16 runs keep PyTorch's defaults."""

from __future__ import annotations

import torch


def exact_fp32(dtype: torch.dtype | str) -> None:
    """Turn TF32 off in this process when the denoiser computes in fp32 (`dtype`); nothing otherwise."""
    if dtype in (torch.float32, "float32"):
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_tf32 = False
