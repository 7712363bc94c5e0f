"""Saved adapters read back for evaluation (`app.models.lora.read_adapter`), and refused with the setting to change
when the config's replicas cannot serve them (another family, rank or targets)."""

import pytest
import torch

from app.models.family import get_family
from app.models.lora import adapter_problem, read_adapter

QWEN_TARGETS = ["to_q", "to_v", "proj_out"]
BAGEL_TARGETS = ["q_proj_moe_gen", "mlp_moe_gen.up_proj"]


def tensors(modules: list[str], rank: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = {}
    for m in modules:
        out[f"{m}.lora_A.weight"] = torch.randn(rank, 16, generator=g)
        out[f"{m}.lora_B.weight"] = torch.randn(16, rank, generator=g)
    return out


def qwen_modules() -> list[str]:
    return [f"transformer_blocks.{i}.attn.{t}" for i in range(2) for t in ("to_q", "to_v")] + ["proj_out"]


def bagel_modules() -> list[str]:
    return [f"language_model.model.layers.{i}.self_attn.q_proj_moe_gen" for i in range(2)] + \
        [f"language_model.model.layers.{i}.mlp_moe_gen.up_proj" for i in range(2)]


@pytest.mark.parametrize("family, modules, targets", [("qwen_image", qwen_modules(), QWEN_TARGETS),
                                                      ("bagel", bagel_modules(), BAGEL_TARGETS)])
def test_an_adapter_saved_as_its_family_saves_it_reads_back_whole(tmp_path, family, modules, targets):
    saved = tensors(modules, rank=4)
    checkpoint = tmp_path / "checkpoint_step_000008"
    get_family(family).save_adapter(checkpoint / "adapter", saved, rank=4, alpha=8, target_modules=targets)
    for path in (checkpoint, checkpoint / "adapter"):  # a checkpoint folder or its adapter folder
        adapter = read_adapter(path, version=3)
        assert (adapter.rank, adapter.alpha, adapter.version) == (4, 8.0, 3)
        assert adapter.target_modules == sorted(targets)
        assert set(adapter.tensors) == set(saved)
        assert all(torch.equal(adapter.tensors[k], v) for k, v in saved.items())
        assert adapter_problem(adapter, family=get_family(family), rank=4, targets=targets) is None


def test_a_diffusers_lora_file_without_metadata_takes_rank_and_targets_from_its_tensors(tmp_path):
    from safetensors.torch import save_file

    save_file({f"transformer.{k}": v for k, v in tensors(qwen_modules(), rank=2).items()},
              str(tmp_path / "pytorch_lora_weights.safetensors"))
    adapter = read_adapter(tmp_path, version=1)
    assert adapter.rank == 2 and adapter.alpha == 2.0 and adapter.target_modules == ["proj_out", "to_q", "to_v"]
    assert "transformer_blocks.0.attn.to_q.lora_A.weight" in adapter.tensors  # the pipeline prefix is dropped


def test_adapters_the_replicas_cannot_serve_are_refused_naming_the_setting(tmp_path):
    qwen, bagel = get_family("qwen_image"), get_family("bagel")
    get_family("qwen_image").save_adapter(tmp_path / "q", tensors(qwen_modules(), 4), rank=4, alpha=4,
                                          target_modules=QWEN_TARGETS)
    adapter = read_adapter(tmp_path / "q", version=1)
    assert "is a LoRA of model.family=qwen_image, not of model.family=bagel" in adapter_problem(
        adapter, family=bagel, rank=4, targets=BAGEL_TARGETS)
    assert "has LoRA rank 4; the config's model.lora_rank=8: set model.lora_rank=4" in adapter_problem(
        adapter, family=qwen, rank=8, targets=QWEN_TARGETS)
    problem = adapter_problem(adapter, family=qwen, rank=4, targets=["to_q", "to_v"])
    assert "trains 'proj_out'" in problem and "set model.lora_target_modules=['proj_out', 'to_q', 'to_v']" in problem
    problem = adapter_problem(adapter, family=qwen, rank=4, targets=[*QWEN_TARGETS, "to_k"])
    assert "does not train 'to_k'" in problem
    with pytest.raises(ValueError, match="no such adapter"):
        read_adapter(tmp_path / "nowhere", version=1)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="expected one LoRA weights file"):
        read_adapter(tmp_path / "empty", version=1)
