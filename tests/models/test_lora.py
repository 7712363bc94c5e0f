"""The LoRA of the in-process engines: a republished adapter is swapped in by one fused copy into the existing
peft parameters, which must leave the transformer exactly as attaching it afresh does."""

import torch
from diffusers import QwenImageTransformer2DModel

from app.models.lora import attach_lora, copy_into_lora, export_lora, random_lora


def test_copying_an_adapter_in_equals_attaching_it(tiny_model_dir):
    load = lambda: QwenImageTransformer2DModel.from_pretrained(tiny_model_dir, subfolder="transformer")  # noqa: E731
    first, second = (random_lora(load(), version=v, rank=4, target_modules=["to_q", "to_v"], seed=v, scale=0.5)
                     for v in (1, 2))
    swapped, fresh = load(), load()
    attach_lora(swapped, first)
    assert copy_into_lora(swapped, second)
    attach_lora(fresh, second)
    got, want = export_lora(swapped, version=2).tensors, export_lora(fresh, version=2).tensors
    assert got.keys() == want.keys() == second.tensors.keys()
    assert all(torch.equal(got[k], want[k]) and torch.equal(got[k], second.tensors[k]) for k in got)

    other_rank = random_lora(load(), version=3, rank=2, target_modules=["to_q", "to_v"], seed=3)
    fewer_targets = random_lora(load(), version=4, rank=4, target_modules=["to_q"], seed=4)
    assert not copy_into_lora(swapped, other_rank) and not copy_into_lora(swapped, fewer_targets)
    kept = export_lora(swapped, version=2).tensors
    assert all(torch.equal(kept[k], second.tensors[k]) for k in kept)  # a refused copy changes nothing
