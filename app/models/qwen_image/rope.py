"""Qwen-Image's rotary embedding in real arithmetic, so that inductor fuses it into the compiled blocks.

diffusers rotates each interleaved pair (x[2k], x[2k+1]) of a query or key by the complex number freqs[s, k]
(`apply_rotary_emb_qwen(use_real=False)`: x viewed as complex, multiplied, viewed back). Inductor generates no code
for complex tensors and runs that multiply as eager kernels between the fused ones. The same rotation in reals,

    out[2k]   = a·c − b·d        out[2k+1] = b·c + a·d        (a, b) = x's pair, (c, d) = (Re, Im) of freqs[s, k]

with c and d read from diffusers' own table (not recomputed as cos and sin of the angle, which would round
differently), in float32 as diffusers computes it, is the complex product to the last bit on the CPU (each output
is one product minus or plus another: `a·c + (−b)·d` is `a·c − b·d` in IEEE arithmetic). vllm-omni rotates in reals
already (its `RotaryEmbedding`, interleaved), so the rollout engines are unaffected.

diffusers picks the rotation per device type from `ROPE_PER_DEVICE` at every attention call; `use_real_rope`
points the CPU and CUDA entries at this function (or back at diffusers' own), and has the rope modules (outside
the compiled blocks) hand their tables on as real views, for every Qwen-Image transformer of the process: the
trainer and the in-process engines each call it with their `model.compile` section.
"""

from __future__ import annotations

import functools

import torch


def apply_rope_real(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """x [B, S, H, D] rotated pairwise by freqs [S, D/2] or [B, S, D/2] (complex, or its `view_as_real` [..., D/2, 2]),
    computed in float32, returned in x's dtype (Z-Image's tables carry the batch: app/models/z_image/rope.py)."""
    if freqs.is_complex():
        freqs = torch.view_as_real(freqs)
    c, d = freqs[..., None, :, 0], freqs[..., None, :, 1]  # [(B,) S, 1, D/2]: broadcast over heads
    a, b = x.float().unflatten(-1, (-1, 2)).unbind(-1)  # the pairs' even and odd entries, [B, S, H, D/2]
    return torch.stack([a * c - b * d, b * c + a * d], dim=-1).flatten(-2).to(x.dtype)


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

