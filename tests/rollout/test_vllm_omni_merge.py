"""vllm-omni's fold of an adapter from the checkpoint's base weights (app/rollout/vllm_omni/merge.py), without an
engine: the base weights of the targets' layers read ahead, and the first fold writing W0 + (α/r)·B·A through the
pipeline's loader (here a recorder of what it is given)."""

import torch

from app.models.lora import PIPELINE_PREFIX
from app.rollout.vllm_omni.merge import CheckpointMerge, checkpoint_layers, read_checkpoint_tensors

TARGETS = ["to_q", "img_mlp.net.2"]


def _merge(model_dir, written: dict) -> CheckpointMerge:
    def load_weights(pairs):
        for name, tensor in pairs:
            written[name] = tensor.clone()
        return set(written)

    return CheckpointMerge(load_weights, model_dir, dtype=torch.float32, device=torch.device("cpu"))


def test_the_base_weights_read_ahead_are_the_checkpoints_and_the_first_fold_uses_them(tiny_model_dir):
    written = {}
    merge = _merge(tiny_model_dir, written)
    layers = checkpoint_layers(merge.folder, TARGETS)
    assert layers and all(n.endswith(".to_q") or n.endswith(".img_mlp.net.2") for n in layers)
    assert merge.keep_ahead(TARGETS) == len(layers)
    merge._ahead.wait()
    stored = read_checkpoint_tensors(merge.folder, [f"{n}.weight" for n in layers])
    assert set(merge.base) == set(layers)
    assert all(torch.equal(merge.base[n], stored[f"{n}.weight"]) for n in layers)

    g = torch.Generator().manual_seed(0)
    adapter = {n: (torch.randn(2, stored[f"{n}.weight"].shape[1], generator=g),
                   torch.randn(stored[f"{n}.weight"].shape[0], 2, generator=g)) for n in layers}
    assert merge.apply(adapter, 0.5) == len(layers)
    for n, (a, b) in adapter.items():
        exact = stored[f"{n}.weight"].double() + 0.5 * b.double() @ a.double()
        assert (written[f"{PIPELINE_PREFIX}{n}.weight"].double() - exact).abs().max() < 1e-5
