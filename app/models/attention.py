"""Which kernels torch's scaled_dot_product_attention may choose among in this process (`model.attention_kernels`):
every family's attention goes through it (diffusers' native backend, SD3's processors, our BAGEL). torch picks the
first that fits the inputs in its own order (cuDNN first on Hopper); allowing only some forces the choice, which is
how they are measured against each other (strictly: when none of the allowed kernels takes the inputs, torch
raises "No viable backend"; math takes every input). Process-wide flags, read when a kernel is chosen (under
torch.compile: when the block is traced), so each process that runs the denoiser sets them before its first
forward."""

from __future__ import annotations

from collections.abc import Sequence

import torch

SDPA_KERNELS = ("cudnn", "flash", "efficient", "math")
_SWITCHES = {"cudnn": torch.backends.cuda.enable_cudnn_sdp, "flash": torch.backends.cuda.enable_flash_sdp,
             "efficient": torch.backends.cuda.enable_mem_efficient_sdp, "math": torch.backends.cuda.enable_math_sdp}
_STATES = {"cudnn": torch.backends.cuda.cudnn_sdp_enabled, "flash": torch.backends.cuda.flash_sdp_enabled,
           "efficient": torch.backends.cuda.mem_efficient_sdp_enabled, "math": torch.backends.cuda.math_sdp_enabled}


def use_sdpa_kernels(kernels: Sequence[str] | None) -> None:
    """Allow only `kernels` (None: leave torch's settings as they are)."""
    if kernels is None:
        return
    unknown = [k for k in kernels if k not in SDPA_KERNELS]
    if unknown or not kernels:
        raise ValueError(f"attention kernels {list(kernels)}: name one or more of {list(SDPA_KERNELS)}")
    for name, switch in _SWITCHES.items():
        switch(name in kernels)


def sdpa_kernels() -> list[str]:
    """The kernels this process allows now."""
    return [name for name in SDPA_KERNELS if _STATES[name]()]
