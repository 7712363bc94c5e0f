"""The compiled path at Qwen-Image's real width in bf16 on one GPU (4 of the 60 blocks, FSDP2 as in a Ray Train
worker): a compiled diffusers engine samples a CFG group with a LoRA served, a compiled policy with the same LoRA
trains on it. Runs on the lent GPU machine; deselected elsewhere.

What it shows (figures printed): the compiled trainer's log-probs (its graph with gradients) are not the compiled
rollout's (graph without), by more than FlowGRPO's clip range, so old log-probs taken from the rollout would clip
from the first pass; with `train.old_logprob=trainer` the first pass's ratio is exactly 1, and recomputing old
log-probs through the training graph (`recompute`) is exact as well."""

import dataclasses

import pytest
import torch

from app.config import CompileConfig, RolloutConfig, TrainConfig
from app.metrics import Stats
from app.models.lora import random_lora
from app.models.qwen_image.real_size import build_full_random_qwen_image
from app.rollout.diffusers_engine import DiffusersEngine
from app.train.policy import Policy
from app.train.update import make_optimizer, recompute_log_probs, train_pass

pytestmark = pytest.mark.gpu
TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
           "img_mlp.net.0.proj", "img_mlp.net.2"]
TRAIN = TrainConfig(old_logprob="trainer", micro_batch_size=8, kl_beta=0.04, timestep_fraction=0.5, clip_range=1e-4)


@pytest.fixture(scope="module")
def real_width_model(tmp_path_factory):
    return build_full_random_qwen_image(tmp_path_factory.mktemp("qwen-image-real-width") / "model", seed=0,
                                        num_layers=4, device="cuda")


def _pass(policy, traj, train):
    stats, mismatch = Stats(), Stats()
    old = recompute_log_probs(policy, train, [traj], mismatch, step=0) if train.old_logprob == "recompute" else [
        traj.log_probs]
    train_pass(policy, make_optimizer(policy, train), train, step=0, epoch=0, trajectories=[traj],
               advantages=[torch.linspace(-1, 1, traj.group_size)], old=old, stats=stats, mismatch=mismatch,
               policy_version=traj.lora_version)
    return stats.result(), mismatch.result()


def test_compiled_first_pass_is_exact_at_real_width(real_width_model, nccl_group, aio, tmp_path):
    settings = CompileConfig(enabled=True, cache_dir=str(tmp_path / "compile_cache"))
    from diffusers import QwenImageTransformer2DModel

    with torch.device("meta"):
        shape = QwenImageTransformer2DModel.from_config(
            QwenImageTransformer2DModel.load_config(real_width_model, subfolder="transformer"))
    adapter = random_lora(shape.to_empty(device="cpu"), version=1, rank=64, target_modules=TARGETS, seed=3,
                          scale=0.05)
    del shape
    engine = DiffusersEngine(real_width_model, dtype="bfloat16", device="cuda", compile=settings)
    aio(engine.start())
    aio(engine.load_lora(adapter))
    request = RolloutConfig(group_size=8, height=512, width=512, num_inference_steps=4, guidance_scale=4.0).request(
        'a storefront sign that says "OPEN"', seed=11, group_id=0)
    traj = aio(engine.generate(request))
    assert engine.compiled and traj.lora_version == 1 and torch.isfinite(traj.log_probs).all()
    engine.pipe = None
    torch.cuda.empty_cache()

    policy = Policy.from_pretrained(real_width_model, lora_rank=64, lora_alpha=128, target_modules=TARGETS,
                                    dtype=torch.bfloat16, device="cuda", adapter_tensors=adapter.tensors,
                                    compile=settings)
    assert policy.sharded and policy.compiled
    figures = {}
    for mode in ("rollout", "trainer", "recompute"):
        stats, mismatch = _pass(policy, traj, dataclasses.replace(TRAIN, old_logprob=mode))
        figures[mode] = {"ratio_dev_first_pass_max": stats["actor/ratio_dev_first_pass_max"],
                         "clipfrac": stats["actor/clipfrac"], **mismatch}
    print("compiled bf16 real width:", figures)
    assert figures["trainer"]["ratio_dev_first_pass_max"] == 0.0
    assert figures["recompute"]["ratio_dev_first_pass_max"] == 0.0
    # the rollout's log-probs: a graph without gradients, the trainer's with (logged every step as the mismatch)
    assert 0 < figures["trainer"]["rollout/logprob_mismatch_max"] < 1e-1
