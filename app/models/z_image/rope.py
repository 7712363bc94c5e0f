"""Z-Image's rotary embedding in real arithmetic, so that inductor fuses it into the compiled blocks and
AOTAutograd's cache can hold their graphs.

diffusers' Z-Image attention (`ZSingleStreamAttnProcessor`) rotates the queries and keys by complex multiplication
inside `torch.amp.autocast("cuda", enabled=False)`: inductor runs the complex multiply as eager kernels, and the
autocast region makes AOTAutograd bypass its cache for every block graph ("Unsupported call_function target
_enter_autocast"), so every start traced them again. The same rotation in reals (`app/models/rope.py`: the complex
product to the last bit on the CPU) needs neither. `use_real_rope` swaps the attention's call for one
that rotates so (the same steps otherwise: projections, norms, attention, output) and has the rope embedder hand
its tables on as real views, for every Z-Image transformer of the process; the trainer and the in-process engines
call it with their `model.compile` section. vllm-omni's Z-Image is its own model, unaffected.
"""

from __future__ import annotations

import torch

from app.models.rope import apply_rope_real


def _real_rope_attention(self, attn, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
                         attention_mask: torch.Tensor | None = None,
                         freqs_cis: torch.Tensor | None = None) -> torch.Tensor:
    """`ZSingleStreamAttnProcessor.__call__` with the rotation in reals."""
    from diffusers.models.attention_dispatch import dispatch_attention_fn

    query = attn.to_q(hidden_states).unflatten(-1, (attn.heads, -1))
    key = attn.to_k(hidden_states).unflatten(-1, (attn.heads, -1))
    value = attn.to_v(hidden_states).unflatten(-1, (attn.heads, -1))
    if attn.norm_q is not None:
        query = attn.norm_q(query)
    if attn.norm_k is not None:
        key = attn.norm_k(key)
    if freqs_cis is not None:
        query, key = apply_rope_real(query, freqs_cis), apply_rope_real(key, freqs_cis)
    if attention_mask is not None and attention_mask.ndim == 2:  # [B, S] -> [B, 1, 1, S]: broadcast over heads
        attention_mask = attention_mask[:, None, None, :]
    out = dispatch_attention_fn(query, key, value, attn_mask=attention_mask, dropout_p=0.0, is_causal=False,
                                backend=self._attention_backend, parallel_config=self._parallel_config)
    out = attn.to_out[0](out.flatten(2, 3).to(query.dtype))
    return attn.to_out[1](out) if len(attn.to_out) > 1 else out


def _real_table(self, ids: torch.Tensor) -> torch.Tensor:
    """The rope embedder's table for `ids` as a real view [..., D/2, 2] (diffusers': complex [..., D/2])."""
    table = _DIFFUSERS["table"](self, ids)
    return torch.view_as_real(table) if table.is_complex() else table


_DIFFUSERS: dict = {}  # diffusers' own calls, kept at the first switch


def use_real_rope(on: bool = True) -> None:
    """Every Z-Image attention of this process rotates in reals (on) or as diffusers does (off)."""
    from diffusers.models.transformers import transformer_z_image as z

    processor, embedder = z.ZSingleStreamAttnProcessor, z.RopeEmbedder
    if not _DIFFUSERS:
        _DIFFUSERS.update(attention=processor.__call__, table=embedder.__call__)
    processor.__call__ = _real_rope_attention if on else _DIFFUSERS["attention"]
    embedder.__call__ = _real_table if on else _DIFFUSERS["table"]
