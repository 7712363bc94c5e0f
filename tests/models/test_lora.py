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


def peft_random_lora(module, *, rank: int, target_modules: list[str], seed: int) -> dict:
    """The independent reference: what peft itself gives with `init_lora_weights=False` under `seed`."""
    from peft import LoraConfig

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        module.add_adapter(LoraConfig(r=rank, lora_alpha=rank, target_modules=target_modules,
                                      init_lora_weights=False), "reference")
    return export_lora(module, version=1, adapter_name="reference").tensors


def test_a_random_adapter_is_peft_s_and_leaves_the_module_as_it_was(tiny_model_dir):
    load = lambda: QwenImageTransformer2DModel.from_pretrained(tiny_model_dir, subfolder="transformer")  # noqa: E731
    targets = ["to_q", "to_v", "img_mlp.net.2"]
    module = load()
    before = {k: v.clone() for k, v in module.state_dict().items()}
    adapter = random_lora(module, version=7, rank=4, target_modules=targets, seed=2, scale=0.5)
    assert module.state_dict().keys() == before.keys() and not getattr(module, "peft_config", None)
    assert all(torch.equal(v, before[k]) for k, v in module.state_dict().items())
    want = peft_random_lora(load(), rank=4, target_modules=targets, seed=2)
    assert adapter.tensors.keys() == want.keys() and len(want) == 3 * 2 * 2  # 2 tiny blocks, A and B each
    for k, v in adapter.tensors.items():
        assert torch.equal(v, want[k] * 0.5 if ".lora_B." in k else want[k]), k
    assert (adapter.version, adapter.rank, adapter.alpha, adapter.target_modules) == (7, 4, 4, sorted(targets))

    served = load()  # a live engine's module: peft's wrappers around the targets, the same names and values
    attach_lora(served, adapter)
    again = random_lora(served, version=7, rank=4, target_modules=targets, seed=2, scale=0.5)
    assert again.tensors.keys() == adapter.tensors.keys()
    assert all(torch.equal(again.tensors[k], adapter.tensors[k]) for k in again.tensors)


def test_a_random_adapter_for_no_layer_is_refused(tiny_model_dir):
    import pytest

    module = QwenImageTransformer2DModel.from_pretrained(tiny_model_dir, subfolder="transformer")
    with pytest.raises(ValueError, match="no linear layer .* matches target_modules=\\['nope'\\]"):
        random_lora(module, version=1, rank=4, target_modules=["nope"], seed=0)
