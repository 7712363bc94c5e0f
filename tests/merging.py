"""What the engines' `rollout.merge_lora` tests share: the same groups from an engine serving the adapter beside its
weights (peft) and from one that folds it in, and what must hold between them."""

from __future__ import annotations

import torch


def sample_both_ways(shared, merging, request, adapter, aio) -> dict:
    """Groups of `request`: `shared` (an engine of the session, left on the base model) on the base model and with
    `adapter`; `merging` (started here, closed by the caller) with `adapter` folded in, then on the base model."""
    out = {"base": aio(shared.generate(request))}
    try:
        aio(shared.load_lora(adapter))
        out["unmerged"] = aio(shared.generate(request))
    finally:
        aio(shared.load_lora(None))
    aio(merging.start())
    aio(merging.load_lora(adapter))
    out["merged"] = aio(merging.generate(request))
    aio(merging.load_lora(None))
    out["again"] = aio(merging.generate(request))
    return out


def assert_merged_is_the_adapter(groups: dict, version: int, moved: float = 1e-3) -> None:
    """In fp32 the folded adapter samples the peft adapter's group to rounding (latents and log-probs), the adapter
    moved the group, and the base model comes back bit for bit."""
    base, unmerged, merged, again = groups["base"], groups["unmerged"], groups["merged"], groups["again"]
    assert merged.lora_version == unmerged.lora_version == version
    assert (merged.latents - base.latents).abs().max() > moved
    torch.testing.assert_close(merged.latents, unmerged.latents, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(merged.log_probs, unmerged.log_probs, rtol=1e-4, atol=1e-4)
    assert again.lora_version == 0 and torch.equal(again.latents, base.latents)
