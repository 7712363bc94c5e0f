"""The diffusers engine and the trainer at Qwen-Image's real width (3072, 24 heads, text states 3584; a few of the 60
blocks) in bf16 on one GPU, from a checkpoint built by `jobs.make_tiny_models --preset qwen-image-full` and loaded
through the normal `model.path` route. Runs on the lent GPU machine; deselected elsewhere.

What holds in bf16: a sample scored in a batch of the size it was sampled in scores as the rollout recorded it (measured
0.0 on an H200, at batch 8 and at batch 1). What does not: the same sample in a batch of another size (1.8e-3 measured
there): the GPU's matrix kernels depend on the batch. (Not cuBLAS's bf16 addition of split-K partial sums: with
`allow_bf16_reduced_precision_reduction = False` the figures were identical.) That is above FlowGRPO's clip range
(1e-4), so the GPU configs train in micro-batches of a whole group (`train.micro_batch_size` = `rollout.group_size`), or
recompute old log-probs (`train.old_logprob: recompute`) where the rollout batches groups together (vllm-omni)."""


import pytest
import torch

from app.config import RolloutConfig
from app.models.qwen_image.real_size import build_full_random_qwen_image
from app.rollout.diffusers_engine import DiffusersEngine
from app.train.policy import Policy

pytestmark = pytest.mark.gpu
TOLERANCE = 1e-3  # bf16 rollout vs bf16 trainer, mean log-density per latent element, same batch size
CROSS_BATCH = 1e-2  # the same across batch sizes (1.8e-3 measured on an H200)
TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
           "img_mlp.net.0.proj", "img_mlp.net.2"]


@pytest.fixture(scope="module")
def real_width_model(tmp_path_factory):
    return build_full_random_qwen_image(tmp_path_factory.mktemp("qwen-image-real-width") / "model", seed=0,
                                        num_layers=4, device="cuda")



def trainer_log_probs(policy, traj, micro_batch: int) -> torch.Tensor:
    out = torch.zeros_like(traj.log_probs)
    with torch.no_grad():
        for start in range(0, traj.group_size, micro_batch):
            samples = list(range(start, start + micro_batch))
            scored = policy.score(traj, range(traj.num_inference_steps), samples)
            out[samples] = torch.stack([o.log_prob.float().cpu() for o in scored], dim=1)
    return out


def test_a_sample_scores_the_same_in_any_batch_at_real_width(real_width_model, nccl_group, aio):
    request = RolloutConfig(group_size=8, height=512, width=512, num_inference_steps=4, guidance_scale=4.0).request(
        'a storefront sign that says "OPEN"', seed=11)
    engine = DiffusersEngine(real_width_model, dtype="bfloat16", device="cuda")
    aio(engine.start())
    batched = aio(engine.generate(request))
    engine.batched_groups = False
    one_by_one = aio(engine.generate(request))
    assert batched.latents.shape == (8, 5, 1024, 64) and torch.isfinite(batched.log_probs).all()
    engine.pipe = None  # the rollout's copy of the weights is no longer needed
    torch.cuda.empty_cache()
    policy = Policy.from_pretrained(real_width_model, lora_rank=64, lora_alpha=128, target_modules=TARGETS,
                                    dtype=torch.bfloat16, device="cuda")
    assert policy.sharded
    mismatches = {}
    for name, traj in (("sampled at batch 8", batched), ("sampled one at a time", one_by_one)):
        for micro_batch in (8, 1):
            mismatches[(name, micro_batch)] = float(
                (trainer_log_probs(policy, traj, micro_batch) - traj.log_probs).abs().max())
    print("bf16 real-width rollout/trainer log-prob mismatch:", mismatches)
    # scored in batches of the size it was sampled in: as the rollout recorded it
    assert mismatches[("sampled at batch 8", 8)] <= TOLERANCE
    assert mismatches[("sampled one at a time", 1)] <= TOLERANCE
    # in a batch of another size: close (the kernels differ), but not within the clip range; the configs avoid it
    assert mismatches[("sampled at batch 8", 1)] <= CROSS_BATCH
    assert mismatches[("sampled one at a time", 8)] <= CROSS_BATCH
