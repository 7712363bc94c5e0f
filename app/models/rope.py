"""The rotary embedding in real arithmetic, for the families whose diffusers attention rotates by complex
multiplication (Qwen-Image, Z-Image: their `rope.py` switch to it when compiling). Each interleaved pair
(x[2k], x[2k+1]) of a query or key is rotated by the complex number freqs[..., k] = c + i·d as

    out[2k]   = a·c − b·d        out[2k+1] = b·c + a·d        (a, b) = x's pair

with c and d read from diffusers' own table (not recomputed as cos and sin of the angle, which would round
differently), in float32 as diffusers computes it: the complex product to the last bit on the CPU (each output is
one product minus or plus another: `a·c + (−b)·d` is `a·c − b·d` in IEEE arithmetic), and no complex tensor for
inductor to run eagerly.
"""

from __future__ import annotations

import torch


def apply_rope_real(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """x [B, S, H, D] rotated pairwise by freqs [S, D/2] or [B, S, D/2] (complex, or its `view_as_real` [..., D/2, 2]),
    computed in float32, returned in x's dtype."""
    if freqs.is_complex():
        freqs = torch.view_as_real(freqs)
    c, d = freqs[..., None, :, 0], freqs[..., None, :, 1]  # [(B,) S, 1, D/2]: broadcast over heads
    a, b = x.float().unflatten(-1, (-1, 2)).unbind(-1)  # the pairs' even and odd entries, [B, S, H, D/2]
    return torch.stack([a * c - b * d, b * c + a * d], dim=-1).flatten(-2).to(x.dtype)
