"""An adapter folded into the weights (app/models/lora_merge.py): each version is W0 + (α/r)·B·A rounded once from
float64's value, swaps never drift, the base comes back bit for bit, layers an adapter leaves out are the base's,
and an adapter that does not fit changes nothing."""

import pytest
import torch

from app.models.lora_merge import AUTO_DEVICE_SHARE, MergedLora, adapter_layers, auto_keep_on
from app.types import LoraAdapter

LAYERS = {"blocks.0.to_q": (24, 16), "blocks.0.to_v": (24, 16), "blocks.1.ff": (40, 24)}  # name: (out, in)


class Net(torch.nn.Module):
    def __init__(self, dtype):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.blocks = torch.nn.ModuleList([torch.nn.ModuleDict(), torch.nn.ModuleDict()])
        for name, (out, inp) in LAYERS.items():
            _, index, leaf = name.split(".")
            layer = torch.nn.Linear(inp, out, dtype=dtype)
            with torch.no_grad():
                layer.weight.copy_(torch.randn(out, inp, generator=g))
            self.blocks[int(index)][leaf] = layer


def _adapter(version: int, rank: int, layers=LAYERS, seed: int = 0, alpha: float = 8.0) -> LoraAdapter:
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, (out, inp) in layers.items():
        tensors[f"transformer.{name}.lora_A.weight"] = torch.randn(rank, inp, generator=g)
        tensors[f"transformer.{name}.lora_B.weight"] = 0.1 * torch.randn(out, rank, generator=g)
    return LoraAdapter(tensors, rank=rank, alpha=alpha, target_modules=sorted({n.split(".")[-1] for n in layers}),
                       version=version)


def _weights(net) -> dict[str, torch.Tensor]:
    return {name: net.get_submodule(name).weight.detach().clone() for name in LAYERS}


def _float64_merge(base: torch.Tensor, adapter: LoraAdapter, name: str) -> torch.Tensor:
    a = adapter.tensors[f"transformer.{name}.lora_A.weight"].double()
    b = adapter.tensors[f"transformer.{name}.lora_B.weight"].double()
    return base.double() + adapter.alpha / adapter.rank * (b @ a)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("keep_on", ["device", "host", "auto"])
def test_a_merged_weight_is_the_float64_sum_rounded_once(dtype, keep_on):
    net = Net(dtype)
    base = _weights(net)
    adapter = _adapter(1, rank=4)
    MergedLora(net, keep_on=keep_on).apply(adapter)
    for name in LAYERS:
        exact = _float64_merge(base[name], adapter, name)
        merged = net.get_submodule(name).weight.detach().double()
        # the one rounding to the weight's dtype (half an ulp) on top of fp32's accumulation of W0 + s·B·A
        a = adapter.tensors[f"transformer.{name}.lora_A.weight"].double()
        b = adapter.tensors[f"transformer.{name}.lora_B.weight"].double()
        magnitude = base[name].double().abs() + adapter.alpha / adapter.rank * (b.abs() @ a.abs())
        bound = 0.5 * torch.finfo(dtype).eps * exact.abs() + (adapter.rank + 1) * 2**-24 * magnitude
        assert ((merged - exact).abs() <= bound).all(), name
        if dtype == torch.bfloat16:  # rounded once: bf16's nearest value almost everywhere
            assert (merged == exact.to(dtype).double()).float().mean() > 0.99


def test_swapping_versions_never_drifts_and_the_base_comes_back_exactly():
    net = Net(torch.bfloat16)
    base = _weights(net)
    merger = MergedLora(net)
    one, two = _adapter(1, rank=4, seed=1), _adapter(2, rank=8, seed=2, alpha=4.0)
    merger.apply(one)
    first = _weights(net)
    for _ in range(50):  # in bf16, adding the new product and subtracting the old would drift by now
        merger.apply(two)
        merger.apply(one)
    assert all(torch.equal(first[n], w) for n, w in _weights(net).items())
    merger.apply(None)
    assert all(torch.equal(base[n], w) for n, w in _weights(net).items())
    assert merger.adapter is None and merger.merged == set()


def test_a_layer_the_next_adapter_leaves_out_is_the_base_again():
    net = Net(torch.bfloat16)
    base = _weights(net)
    merger = MergedLora(net)
    merger.apply(_adapter(1, rank=4))
    fewer = {k: v for k, v in LAYERS.items() if k != "blocks.0.to_v"}
    merger.apply(_adapter(2, rank=4, layers=fewer, seed=3))
    after = _weights(net)
    assert torch.equal(after["blocks.0.to_v"], base["blocks.0.to_v"])
    assert not torch.equal(after["blocks.0.to_q"], base["blocks.0.to_q"])
    assert merger.merged == set(fewer)


def test_the_merged_forward_is_the_adapters_forward():
    """x·(W0 + s·B·A)ᵀ against the unmerged x·W0ᵀ + s·(x·Aᵀ)·Bᵀ, both in float64 (the math, not the rounding)."""
    net = Net(torch.float64)
    adapter = _adapter(1, rank=4)
    x = torch.randn(5, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    layer = net.get_submodule("blocks.0.to_q")
    a = adapter.tensors["transformer.blocks.0.to_q.lora_A.weight"].double()
    b = adapter.tensors["transformer.blocks.0.to_q.lora_B.weight"].double()
    unmerged = layer(x) + adapter.alpha / adapter.rank * (x @ a.T) @ b.T
    MergedLora(net).apply(adapter)
    torch.testing.assert_close(layer(x), unmerged, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(("mangle", "message"), [
    (lambda t: {**t, "transformer.blocks.0.nowhere.lora_A.weight": torch.zeros(4, 16),
                "transformer.blocks.0.nowhere.lora_B.weight": torch.zeros(24, 4)},
     "'blocks.0.nowhere': the module has no such linear layer"),
    (lambda t: {**t, "transformer.blocks.1.ff.lora_A.weight": torch.zeros(4, 16)}, "do not fit its weight"),
    (lambda t: {k: v for k, v in t.items() if k != "transformer.blocks.1.ff.lora_B.weight"},
     "has only one of lora_A / lora_B"),
], ids=["unknown-layer", "wrong-shape", "half-a-pair"])
def test_an_adapter_that_does_not_fit_changes_nothing(mangle, message):
    net = Net(torch.bfloat16)
    merger = MergedLora(net)
    good = _adapter(1, rank=4)
    merger.apply(good)
    before = _weights(net)
    bad = LoraAdapter(mangle(dict(good.tensors)), rank=4, alpha=8.0, target_modules=good.target_modules, version=2)
    with pytest.raises(ValueError, match=message):
        merger.apply(bad)
    assert all(torch.equal(before[n], w) for n, w in _weights(net).items())
    assert merger.adapter is good


def test_a_merge_that_fails_halfway_leaves_the_base_model(monkeypatch):
    """Out of memory on the second layer: the first layer's new weight must not stay beside the others' old ones."""
    net = Net(torch.bfloat16)
    base = _weights(net)
    merger = MergedLora(net)
    merger.apply(_adapter(1, rank=4))
    calls, addmm = [], torch.addmm

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return addmm(*args, **kwargs)

    monkeypatch.setattr(torch, "addmm", failing)
    with pytest.raises(torch.OutOfMemoryError):
        merger.apply(_adapter(2, rank=4, seed=7))
    assert all(torch.equal(base[n], w) for n, w in _weights(net).items())
    assert merger.adapter is None and merger.merged == set()


def test_new_base_weights_take_the_adapter_again():
    net = Net(torch.float32)
    merger = MergedLora(net)
    adapter = _adapter(1, rank=4)
    merger.apply(adapter)
    new = torch.randn(24, 16, generator=torch.Generator().manual_seed(5))
    assert merger.load_base({"blocks.0.to_q.weight": new}) == []
    exact = _float64_merge(new, adapter, "blocks.0.to_q")
    torch.testing.assert_close(net.get_submodule("blocks.0.to_q").weight.double(), exact, rtol=1e-6, atol=1e-6)
    merger.apply(None)
    assert torch.equal(net.get_submodule("blocks.0.to_q").weight, new)
    before = _weights(net)
    assert merger.load_base({"blocks.0.unknown.weight": new}) == ["blocks.0.unknown.weight"]
    assert all(torch.equal(before[n], w) for n, w in _weights(net).items())


def test_adapter_layers_reads_peft_and_diffusers_names():
    tensors = {"base_model.model.blocks.0.to_q.lora_A.weight": torch.zeros(2, 3),
               "blocks.0.to_q.lora_B.weight": torch.zeros(4, 2)}
    layers = adapter_layers(LoraAdapter(tensors, rank=2, alpha=2.0, target_modules=["to_q"], version=1))
    assert list(layers) == ["blocks.0.to_q"] and layers["blocks.0.to_q"][1].shape == (4, 2)


def test_where_the_base_is_kept_is_checked():
    with pytest.raises(ValueError, match="keep_on='gpu'"):
        MergedLora(Net(torch.float32), keep_on="gpu")


def test_auto_keeps_the_copy_on_the_gpu_only_where_it_leaves_room():
    gib = 2**30
    assert auto_keep_on(27 * gib, 84 * gib) == "device"  # Qwen-Image's 12 targets, a replica alone on an H200
    assert auto_keep_on(27 * gib, 23 * gib) == "host"  # the same replica on an H100
    assert auto_keep_on(int(AUTO_DEVICE_SHARE * 40 * gib), 40 * gib) == "device"
    assert auto_keep_on(int(AUTO_DEVICE_SHARE * 40 * gib) + 1, 40 * gib) == "host"
    assert auto_keep_on(27 * gib, None) == "device"  # not on a GPU: one memory


def test_auto_decides_at_the_first_adapter_and_keeps_to_it():
    merged = MergedLora(Net(torch.float32), keep_on="auto")
    merged.apply(None)
    assert merged.keep_on == "auto"  # the base model needs no copy yet
    merged.apply(_adapter(1, rank=4))
    assert merged.keep_on == "device" and set(merged.base) == set(LAYERS)


def test_host_copies_taken_ahead_fold_the_first_adapter_as_copies_taken_then():
    """An engine that knows its adapters' targets takes the host copies from the start (keep_ahead): before any
    adapter the copies are there, the base model's own values, and the first fold is bit for bit the fold of an
    engine that took them at the first adapter."""
    ahead, lazy = Net(torch.bfloat16), Net(torch.bfloat16)
    base = _weights(ahead)
    merged_ahead = MergedLora(ahead, keep_on="host")
    merged_ahead.keep_ahead(LAYERS)
    merged_ahead._wait_ahead()
    assert set(merged_ahead.base) == set(LAYERS)
    assert all(torch.equal(merged_ahead.base[name], base[name]) for name in LAYERS)
    adapter = _adapter(1, rank=4)
    merged_ahead.apply(adapter)
    MergedLora(lazy, keep_on="host").apply(adapter)
    assert all(torch.equal(w, _weights(lazy)[name]) for name, w in _weights(ahead).items())


def test_keeping_ahead_waits_for_the_first_adapter_where_the_copy_could_go_to_the_device():
    """Off a GPU "auto" would keep the copy beside the weights (one memory), and a device copy is quick: nothing is
    taken ahead, and "auto" still decides at the first adapter."""
    merged = MergedLora(Net(torch.float32), keep_on="auto")
    merged.keep_ahead(LAYERS)
    assert not merged._ahead.started and merged.keep_on == "auto" and not merged.base
    merged = MergedLora(Net(torch.float32), keep_on="device")
    merged.keep_ahead(LAYERS)
    assert not merged._ahead.started and not merged.base
