"""The real-size random Qwen-Image builder, at the real width but one block deep (a CPU can hold that): Qwen-Image's
shapes, deterministic from the seed, and loadable through the normal `model.path` route by the rollout engine and
the trainer, which sample and score it alike. The 60-block build runs on the GPU machine (docs/performance.md)."""

import pytest
import torch

from app.config import RolloutConfig
from app.models.builds import randomise
from app.models.qwen_image.real_size import TRANSFORMER, build_full_random_qwen_image
from app.rollout.diffusers_engine import DiffusersEngine
from app.train.policy import Policy

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def one_block(tmp_path_factory):
    return build_full_random_qwen_image(tmp_path_factory.mktemp("full") / "model", seed=3, num_layers=1,
                                        text_layers=1, device="cpu")


def test_the_real_shapes_in_bf16(one_block):
    from diffusers import QwenImageTransformer2DModel
    from transformers import AutoConfig

    config = QwenImageTransformer2DModel.load_config(one_block / "transformer")
    assert {k: config[k] for k in TRANSFORMER if k != "axes_dims_rope"} == {
        **{k: v for k, v in TRANSFORMER.items() if k != "axes_dims_rope"}, "num_layers": 1}
    assert (config["num_attention_heads"] * config["attention_head_dim"], config["joint_attention_dim"]) == (3072, 3584)
    text = AutoConfig.from_pretrained(one_block / "text_encoder").text_config
    assert (text.hidden_size, text.num_hidden_layers) == (3584, 1)
    assert (one_block / "tiny_build.json").is_file()
    # same seed again: the builder recognises its own build and keeps it
    assert build_full_random_qwen_image(one_block, seed=3, num_layers=1, text_layers=1, device="cpu") == one_block


def test_the_same_seed_gives_the_same_weights(one_block):
    from safetensors import safe_open

    def draw(seed):
        module = torch.nn.ModuleDict({"proj": torch.nn.Linear(64, 64), "norm": torch.nn.LayerNorm(64)})
        module = module.to(torch.bfloat16)
        randomise(module, torch.Generator().manual_seed(seed))
        return module

    a, b, c = draw(5), draw(5), draw(6)
    assert torch.equal(a.proj.weight, b.proj.weight) and not torch.equal(a.proj.weight, c.proj.weight)
    assert torch.equal(a.norm.weight, torch.ones(64, dtype=torch.bfloat16)) and not a.proj.bias.any()
    # the built transformer holds such draws: N(0, 0.02) matrices, in bf16
    (shard,) = (one_block / "transformer").glob("*.safetensors")
    with safe_open(shard, "pt") as f:
        weight = f.get_tensor("transformer_blocks.0.attn.to_q.weight")
    assert weight.dtype == torch.bfloat16 and 0.019 < weight.float().std().item() < 0.021


def test_the_engine_samples_it_and_the_trainer_scores_it(one_block, aio):
    # fp32 on the CPU (bf16 matrix products are ~50x slower there); bf16 numerics: tests/train/test_real_width_gpu.py
    engine = DiffusersEngine(one_block, dtype="float32", device="cpu")
    request = RolloutConfig(group_size=2, height=64, width=64, num_inference_steps=2).request('a sign "OPEN"', seed=1)
    traj = aio(engine.generate(request))
    assert traj.images.shape == (2, 64, 64, 3) and torch.isfinite(traj.log_probs).all()
    policy = Policy.from_pretrained(one_block, lora_rank=4, lora_alpha=4, target_modules=["to_q", "to_v"],
                                    dtype=torch.float32, shard=False)
    with torch.no_grad():
        scored = policy.score(traj, range(2), range(2))
    mismatch = (torch.stack([o.log_prob.float() for o in scored], dim=1) - traj.log_probs).abs().max()
    assert mismatch <= 1e-5
