"""SD3.5-Medium's real size on one GPU, random weights (`jobs.make_tiny_models --preset sd35-medium`, loaded through
the normal `model.path` route): the diffusers engine samples a group of 8 at 512² with CFG 4.5 in bf16, and the FSDP2
policy scores it as the rollout recorded it when scored in micro-batches of the group's size (as sd35m_ocr.yaml
trains). Runs on the lent GPU machine; deselected elsewhere. (On the CPU, one block of the real width in fp32: the
engine's log-probs equal the trainer's exactly, 0.0, checked by hand when the builder was written.)"""

import os

import pytest
import torch

from app.config import RolloutConfig
from app.models.sd3 import FAMILY
from app.models.sd3.real_size import build_random_sd35_medium
from app.rollout.sd3_engine import SD3Engine
from app.train.policy import Policy

pytestmark = pytest.mark.gpu
TOLERANCE = 1e-3  # bf16 rollout vs bf16 trainer, same batch size (tests/train/test_real_width_gpu.py)


@pytest.fixture(scope="module")
def sd35_medium(tmp_path_factory):
    if os.environ.get("SD35M_PATH"):  # a checkpoint `jobs.make_tiny_models --preset sd35-medium` already built
        return os.environ["SD35M_PATH"]
    return build_random_sd35_medium(tmp_path_factory.mktemp("sd35m") / "model", seed=0, device="cuda")


def test_sd35_medium_samples_and_scores_alike_in_bf16(sd35_medium, nccl_group, aio):
    request = RolloutConfig(group_size=8, height=512, width=512, num_inference_steps=10, guidance_scale=4.5,
                            negative_prompt="").request('a storefront sign that says "OPEN"', seed=11)
    engine = SD3Engine(sd35_medium, dtype="bfloat16", device="cuda")
    aio(engine.start())
    traj = aio(engine.generate(request))
    assert traj.latents.shape == (8, 11, 16, 64, 64) and torch.isfinite(traj.log_probs).all()
    engine.pipe = None
    torch.cuda.empty_cache()
    policy = Policy.from_pretrained(sd35_medium, lora_rank=32, lora_alpha=64, target_modules=list(FAMILY.lora_targets),
                                    dtype=torch.bfloat16, device="cuda", family="sd3")
    with torch.no_grad():
        scored = policy.score(traj, range(traj.num_inference_steps), range(8))
    mismatch = float((torch.stack([o.log_prob.float().cpu() for o in scored], dim=1) - traj.log_probs).abs().max())
    print(f"bf16 SD3.5-Medium rollout/trainer log-prob mismatch (batch 8): {mismatch}")
    assert mismatch <= TOLERANCE
