"""Which kernels torch's scaled_dot_product_attention may choose among in this process (`model.attention_kernels`):
every family's attention goes through it (diffusers' native backend, SD3's processors, our BAGEL). torch picks the
first that fits the inputs in its own order (cuDNN first on Hopper); allowing only some forces the choice, which is
how they are measured against each other (strictly: when none of the allowed kernels takes the inputs, torch
raises "No viable backend"; math takes every input). Process-wide flags, read when a kernel is chosen (under
torch.compile: when the block is traced), so each process that runs the denoiser sets them before its first
forward."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

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


# cuDNN's attention backward is checked before a trainer relies on it: on an H200 under torch 2.11 / cuDNN 9.19 it
# returned gradients uncorrelated with the true ones (relative error 1.4) whenever the output's gradient came as a
# transposed view of [B, S, H, D] memory, the layout every diffusers model hands back, and FLUX.1's trainer under
# torch 2.13 / cuDNN 9.20 hit an illegal memory access there (docs/perf/flux/). The forward is right: engines keep it.
BACKWARD_TOLERANCE = 2e-2  # relative error of a gradient against fp32 math: bf16 kernels are near 3e-3
# The shapes measured on a GPU ([B, S, H]): the fault depends on them. Under torch 2.13 / cuDNN 9.20 on an H200 cuDNN
# was right at 320 tokens and 4 heads and wrong at FLUX.1's 1152 tokens and 24 heads (and Z-Image's 1056 and 30), so
# the check measures a trainer's shape, not only a small one (docs/perf/vllm_omni/lease7_h200_2026-11-29/).
GPU_CHECK_SHAPES = ((2, 320, 4), (2, 1152, 24))
CPU_CHECK_SHAPES = ((2, 320, 4),)  # a CPU has no cuDNN: the child's plumbing only


def backward_errors(attention: Callable[..., torch.Tensor], device: torch.device | str = "cpu", *,
                    dtype: torch.dtype = torch.float32, head_dim: int = 128, heads: int = 4, seq: int = 320,
                    batch: int = 2, seed: int = 0) -> list[float]:
    """Relative errors of dq, dk, dv from `attention(q, k, v)` ([B, H, S, D] in and out, in `dtype`) against torch's
    math kernel in fp32, with inputs and the output's gradient laid out as diffusers lays them out: transposed views
    of [B, S, H, D] memory."""
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def bshd() -> torch.Tensor:
        return torch.randn(batch, seq, heads, head_dim, generator=gen).to(device)

    q, k, v, grad = (bshd() for _ in range(4))

    def grads(fn, cast: torch.dtype) -> list[torch.Tensor]:
        leaves = [t.to(cast, copy=True).requires_grad_() for t in (q, k, v)]
        out = fn(*(t.transpose(1, 2) for t in leaves))
        out.backward(grad.to(cast).transpose(1, 2))
        return [t.grad.double() for t in leaves]

    reference = grads(_kernel("math"), torch.float32)
    return [float((g - r).norm() / r.norm()) for g, r in zip(grads(attention, dtype), reference, strict=True)]


def _kernel(name: str) -> Callable[..., torch.Tensor]:
    """torch's attention allowed only kernel `name`."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
               "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}[name]

    def attention(*qkv: torch.Tensor) -> torch.Tensor:
        with sdpa_kernel([backend]):
            return torch.nn.functional.scaled_dot_product_attention(*qkv)

    return attention


@functools.cache
def backward_problem(kernel: str, device: str) -> str | None:
    """What is wrong with `kernel`'s attention backward on `device` (None: right within BACKWARD_TOLERANCE at head
    dims 64 and 128, at each of GPU_CHECK_SHAPES on a GPU). Measured in a child process: a kernel that faults
    poisons its process's CUDA context."""
    root = str(Path(__file__).resolve().parents[2])  # the child imports this project wherever the caller runs
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.run([sys.executable, "-m", "app.models.attention", kernel, device], capture_output=True,
                          text=True, timeout=300, env=env, cwd=root)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return f"its attention backward failed on {device} ({last})"
    errors = json.loads(proc.stdout.strip().splitlines()[-1])
    where, worst = max(((shape, max(e)) for shape, e in errors.items()), key=lambda item: item[1])
    if worst <= BACKWARD_TOLERANCE:
        return None
    return (f"its attention backward is wrong on {device} under torch {torch.__version__}, cuDNN "
            f"{torch.backends.cudnn.version()}: gradients {worst:.2g} off fp32 math (relative; bound "
            f"{BACKWARD_TOLERANCE:g}) at {where} when they arrive in diffusers' [B, S, H, D] layout")


def trainer_kernels(kernels: Sequence[str] | None, device: torch.device) -> list[str] | None:
    """The kernels a trainer allows (`model.attention_kernels`): as listed, or, when none are listed, torch's less
    cuDNN's on a CUDA device. Its backward gave gradients 1.4 off in diffusers' layout (torch 2.11 and 2.13 on H200s)
    and faulted FLUX.1's real-size trainer twice (illegal memory access; lease 8's check at 1152 tokens passed and the
    trainer still faulted): flash and memory-efficient attention are right at every shape measured. Listing cudnn
    keeps it, under the check (`check_backward_in_background`)."""
    if kernels is not None:
        return list(kernels)
    if device.type != "cuda":
        return None
    return [k for k in sdpa_kernels() if k != "cudnn"]


def check_backward_in_background(device: torch.device) -> Callable[[], str | None]:
    """`leave_out_broken_backward` in two halves, so that its few seconds pass beside the caller's own work (a
    trainer's model load): the measurement starts now, in a thread; the returned call waits for it, applies it and
    returns why cuDNN's kernel was left out (None: nothing changed)."""
    if device.type != "cuda" or "cudnn" not in sdpa_kernels():
        return lambda: None
    pool = ThreadPoolExecutor(1, thread_name_prefix="cudnn-backward-check")
    measured = pool.submit(backward_problem, "cudnn", str(device))
    pool.shutdown(wait=False)

    def apply() -> str | None:
        problem = measured.result()
        if problem is not None:
            use_sdpa_kernels([k for k in sdpa_kernels() if k != "cudnn"])
        return problem

    return apply


def leave_out_broken_backward(device: torch.device) -> str | None:
    """A trainer's check before its first backward: on a CUDA device whose cuDNN attention backward is wrong
    (`backward_problem`), cuDNN's kernel is no longer allowed in this process (the others stay); returns why, or
    None when nothing changed."""
    return check_backward_in_background(device)()


if __name__ == "__main__":  # python -m app.models.attention KERNEL DEVICE: its backward errors, one JSON line
    kernel, device = sys.argv[1], sys.argv[2]
    cuda = device.startswith("cuda")
    dtype, shapes = (torch.bfloat16, GPU_CHECK_SHAPES) if cuda else (torch.float32, CPU_CHECK_SHAPES)
    print(json.dumps({f"B={b} S={s} H={h} D={d}": backward_errors(_kernel(kernel), device, dtype=dtype, head_dim=d,
                                                                   batch=b, seq=s, heads=h)
                      for b, s, h in shapes for d in (64, 128)}))
