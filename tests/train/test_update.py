"""The update's parts on the tiny model: recomputed old log-probs are scored at exactly the steps this optimizer
step trains (every other step keeps the rollout's value, which nothing reads)."""

import torch

from app.algo.timesteps import trained_steps
from app.config import RolloutConfig, TrainConfig
from app.metrics import Stats
from app.models.lora import random_lora
from app.rollout.diffusers_engine import DiffusersEngine
from app.train.policy import Policy
from app.train.update import recompute_log_probs

TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]


def test_recompute_scores_only_the_trained_steps(tiny_model_dir, aio):
    engine = DiffusersEngine(tiny_model_dir, dtype="float32", device="cpu")
    aio(engine.start())
    request = RolloutConfig(group_size=4, height=64, width=64, num_inference_steps=6).request("a red sign", seed=3,
                                                                                             group_id=5)
    traj = aio(engine.generate(request))
    # a policy that is not the rollout's (a random adapter): its log-probs differ from the recorded ones
    from diffusers import QwenImageTransformer2DModel

    adapter = random_lora(QwenImageTransformer2DModel.from_pretrained(tiny_model_dir, subfolder="transformer"),
                          version=1, rank=4, target_modules=TARGETS, seed=11, scale=0.5)
    policy = Policy.from_pretrained(tiny_model_dir, lora_rank=4, lora_alpha=4, target_modules=TARGETS,
                                    adapter_tensors=adapter.tensors, shard=False)
    train = TrainConfig(timestep_fraction=0.34, micro_batch_size=2, num_inner_epochs=2, seed=0)
    step = 7
    expected_steps = sorted({i for epoch in range(2) for i in trained_steps(6, 0.34, seed=0, step=step, group=5,
                                                                            epoch=epoch)})
    assert 0 < len(expected_steps) < 6
    mismatch = Stats()
    (old,) = recompute_log_probs(policy, train, [traj], mismatch, step=step)
    with torch.no_grad():  # scored as the recompute does, in micro-batches of 2 (fp32 sums depend on the batch)
        full = torch.cat([torch.stack([o.log_prob for o in policy.score(traj, range(6), samples)], dim=1)
                          for samples in ([0, 1], [2, 3])])
    others = [i for i in range(6) if i not in expected_steps]
    assert torch.equal(old[:, expected_steps], full[:, expected_steps])
    assert torch.equal(old[:, others], traj.log_probs[:, others])
    assert (full[:, others] - traj.log_probs[:, others]).abs().max() > 1e-4  # so the copy is not a coincidence
    assert mismatch.result()["rollout/logprob_mismatch_max"] > 0
