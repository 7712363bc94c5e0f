"""Qwen-Image's rotary embedding in real arithmetic, so that inductor fuses it into the compiled blocks.

diffusers rotates each interleaved pair of a query or key by a complex number (`apply_rotary_emb_qwen(use_real=False)`:
x viewed as complex, multiplied, viewed back); inductor generates no code for complex tensors and runs that multiply
as eager kernels between the fused ones. `apply_rope_real` (app/models/rope.py) is the same rotation in reals, the
complex product to the last bit on the CPU. vllm-omni rotates in reals already (its `RotaryEmbedding`, interleaved),
so the rollout engines are unaffected.

diffusers picks the rotation per device type from `ROPE_PER_DEVICE` at every attention call; `use_real_rope`
points the CPU and CUDA entries at `apply_rope_real` (or back at diffusers' own), and has the rope modules (outside
the compiled blocks) hand their tables on as real views, for every Qwen-Image transformer of the process: the
trainer and the in-process engines each call it with their `model.compile` section.
"""

from __future__ import annotations

import functools

import torch

from app.models.rope import apply_rope_real


def _real_tables(forward):
    """A rope module's forward that hands its complex tables on as real views (`view_as_real`), so that no complex
    tensor enters a compiled block (inductor would run whatever touches it eagerly)."""
    @functools.wraps(forward)
    def real_forward(self, *args, **kwargs):
        return tuple(torch.view_as_real(f) if f.is_complex() else f for f in forward(self, *args, **kwargs))

    real_forward.complex_forward = forward
    return real_forward


def use_real_rope(on: bool = True) -> None:
    """Every Qwen-Image attention of this process rotates with `apply_rope_real` (on) or diffusers' complex
    multiply (off) on the CPU and on CUDA; with it on, the rope modules hand on real tables."""
    from diffusers.models.transformers import transformer_qwenimage as qwen

    for cls in (qwen.QwenEmbedRope, qwen.QwenEmbedLayer3DRope):
        complex_forward = getattr(cls.forward, "complex_forward", cls.forward)
        cls.forward = _real_tables(complex_forward) if on else complex_forward
    if on:
        qwen.ROPE_PER_DEVICE["cuda"] = qwen.ROPE_PER_DEVICE["cpu"] = apply_rope_real
    else:
        qwen.ROPE_PER_DEVICE["cuda"] = functools.partial(qwen.apply_rotary_emb_qwen, use_real=False)
        qwen.ROPE_PER_DEVICE.pop("cpu", None)  # diffusers' default for any device it does not list

