"""SD3's blocks compiled (CPU, inductor), as `model.compile` compiles them: a compiled SD3 engine samples groups with
CFG and a LoRA, a compiled, checkpointed policy trains on them with `train.old_logprob=trainer`, the first pass's
ratio is exactly 1, and after the first group nothing compiles again (another prompt, an SDE window, another adapter
version): SD3's three kinds of block (dual attention, plain, the last with its short text stream) each compile once
per variant. The Qwen-Image checks of the compiled path: tests/train/test_compiled.py."""

import pytest
import torch

from app.config import CompileConfig, RolloutConfig, TrainConfig
from app.metrics import Stats
from app.models.compile import compile_counts
from app.models.lora import random_lora
from app.models.sd3 import FAMILY
from app.rollout.sd3_engine import SD3Engine
from app.train.policy import Policy
from app.train.update import make_optimizer, train_pass

pytestmark = pytest.mark.slow

TARGETS = list(FAMILY.lora_targets)
ROLLOUT = RolloutConfig(group_size=4, height=64, width=64, num_inference_steps=4, guidance_scale=4.5)
TRAIN = TrainConfig(old_logprob="trainer", micro_batch_size=4, kl_beta=0.04, timestep_fraction=1.0, clip_range=1e-4,
                    learning_rate=1e-3)


def _adapter(model_dir, version: int):
    transformer = FAMILY.load_denoiser(model_dir, dtype=torch.float32, device=torch.device("cpu"))
    return random_lora(transformer, version=version, rank=4, target_modules=TARGETS, seed=version, scale=0.5)


def test_compiled_sd3_first_pass_is_exact_and_nothing_compiles_again(tiny_sd3_dir, tmp_path):
    settings = CompileConfig(enabled=True, cache_dir=str(tmp_path / "compile_cache"))
    adapter = _adapter(tiny_sd3_dir, 1)
    engine = SD3Engine(tiny_sd3_dir, compile=settings)
    engine.load()
    engine._load_lora(adapter)
    policy = Policy.from_pretrained(tiny_sd3_dir, lora_rank=4, lora_alpha=4, target_modules=TARGETS, shard=False,
                                    adapter_tensors=adapter.tensors, compile=settings, gradient_checkpointing=True,
                                    family="sd3")
    assert engine.compiled and policy.compiled

    def step(prompt: str, seed: int, **fields) -> dict:
        traj = engine.sample(ROLLOUT.request(prompt, seed=seed, group_id=seed, **fields))
        stats, mismatch = Stats(), Stats()
        optimizer = make_optimizer(policy, TRAIN)
        optimizer.step = lambda: None  # keep the weights: the adapter the engine serves stays the policy's
        train_pass(policy, optimizer, TRAIN, step=seed, epoch=0, trajectories=[traj],
                   advantages=[torch.tensor([1.0, -0.5, 0.25, -0.75])], old=[traj.log_probs], stats=stats,
                   mismatch=mismatch, policy_version=traj.lora_version)
        return {**stats.result(), **mismatch.result()}

    first = step('a sign that says "RL"', 0)
    assert first["actor/ratio_dev_first_pass_max"] == 0.0  # exactly
    assert first["rollout/logprob_mismatch_max"] < 1e-4  # logged: the engine's graph is not the trainer's
    before = compile_counts()
    engine._load_lora(_adapter(tiny_sd3_dir, 2))
    later = step('a poster with the words "FLOW GRPO" in large letters', 1, sde_window=(1, 3))
    assert later["actor/ratio_dev_first_pass_max"] == 0.0
    assert compile_counts() == before
