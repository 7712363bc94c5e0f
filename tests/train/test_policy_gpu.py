"""The policy on a CUDA GPU in bf16 under FSDP2 (NCCL): the mixed-precision path the GPU config takes (bf16
base and compute, fp32 LoRA and gradient reduction). Runs on the lent GPU machine; deselected elsewhere."""


import pytest
import torch

from app.rollout.diffusers_engine import DiffusersEngine
from app.train.policy import Policy
from app.types import GenerationRequest

pytestmark = pytest.mark.gpu



def test_bf16_fsdp2_policy_on_cuda_scores_the_rollout_and_trains(nccl_group, tiny_model_dir, aio):
    engine = DiffusersEngine(tiny_model_dir, dtype="bfloat16", device="cuda")
    aio(engine.start())
    traj = aio(engine.generate(GenerationRequest('a sign that says "GPU"', n=4, height=64, width=64,
                                                 num_inference_steps=4, noise_level=0.7, sde_type="sde", seed=3)))
    policy = Policy.from_pretrained(tiny_model_dir, lora_rank=4, lora_alpha=4,
                                    target_modules=["to_q", "to_k", "to_v", "to_out.0", "proj_out"],
                                    dtype=torch.bfloat16, device="cuda")
    assert policy.sharded and {p.dtype for p in policy.parameters()} == {torch.float32}  # fp32 master LoRA
    outs = policy.score(traj, range(traj.num_inference_steps), range(4))
    log_prob = torch.stack([o.log_prob for o in outs], dim=1)  # [4, T]
    mismatch = (log_prob.detach().float().cpu() - traj.log_probs).abs().max().item()
    print(f"bf16 cuda rollout/trainer log-prob mismatch: {mismatch:.3e}")
    assert mismatch <= 1e-3
    before = policy.export_adapter(version=1).tensors
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-2)
    (-(torch.tensor([1.0, -1.0, 0.5, -0.5], device="cuda")[:, None] * log_prob).mean()).backward()
    norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
    norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    assert norm > 0 and norm == norm
    optimizer.step()
    after = policy.export_adapter(version=2).tensors
    assert all(v.device.type == "cpu" and v.dtype == torch.float32 for v in after.values())
    assert any(not torch.equal(after[k], before[k]) for k in before if ".lora_B." in k)
    with torch.no_grad(), policy.reference():
        (ref,) = policy.score(traj, [1], range(4))
    (tuned,) = policy.score(traj, [1], range(4))
    assert (tuned.prev_sample_mean - ref.prev_sample_mean).abs().max() > 0
