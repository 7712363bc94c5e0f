"""vLLM's compiled activation ops that its layers bind when they are built on a CPU platform, defined for the CPU
where the installed vLLM lacks them (the CUDA wheel has no CPU kernels): `SiluAndMul` (BAGEL's and Qwen2's MLPs)
and `NewGELU` (vllm-omni's T5 encoder, FLUX's) look `torch.ops._C.<op>` up in `__init__`; on the CPU platform their
forwards run the native path. Defined through torch.library, only when missing; a no-op on CUDA machines."""

from __future__ import annotations

import math

import torch

_LIBRARY = None  # the torch.library fragment must outlive this call


def _silu_and_mul(out: torch.Tensor, x: torch.Tensor) -> None:
    half = x.shape[-1] // 2
    out.copy_(torch.nn.functional.silu(x[..., :half]) * x[..., half:])


def _gelu_new(out: torch.Tensor, x: torch.Tensor) -> None:
    c = math.sqrt(2.0 / math.pi)
    out.copy_(0.5 * x * (1.0 + torch.tanh(c * (x + 0.044715 * torch.pow(x, 3.0)))))


_OPS = {"silu_and_mul": _silu_and_mul, "gelu_new": _gelu_new}  # each `op(Tensor(a!) out, Tensor x) -> ()`


def define_missing_ops() -> None:
    """Define each op of `_OPS` under `_C` for the CPU when vLLM's compiled ops lack it."""
    global _LIBRARY
    if torch.cuda.is_available():
        return
    for name, impl in _OPS.items():
        try:
            getattr(torch.ops._C, name)
            continue
        except (AttributeError, RuntimeError):
            pass
        _LIBRARY = _LIBRARY or torch.library.Library("_C", "FRAGMENT")
        _LIBRARY.define(f"{name}(Tensor(a!) out, Tensor x) -> ()")
        _LIBRARY.impl(name, impl, "CPU")
