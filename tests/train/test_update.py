"""The update's parts on the tiny model: recomputed old log-probs are scored at exactly the steps this optimizer
step trains (every other step keeps the rollout's value, which nothing reads)."""

import pytest
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


def _one_pass(policy, train, traj, policy_version):
    from app.train.update import make_optimizer, train_pass

    stats, mismatch = Stats(), Stats()
    optimizer = make_optimizer(policy, train)
    optimizer.step = lambda: None  # score the same policy every time
    train_pass(policy, optimizer, train, step=0, epoch=0, trajectories=[traj],
               advantages=[torch.tensor([1.0, -1.0, 0.5, -0.5])], old=[traj.log_probs], stats=stats,
               mismatch=mismatch, policy_version=policy_version)
    return stats.result(), mismatch.result(), [p.grad.clone() for p in policy.parameters()]


def test_old_log_probs_from_the_trainer_are_the_rollouts_where_they_match_and_weigh_a_stale_group(tiny_model_dir,
                                                                                                   aio):
    """An on-policy group of an exact engine: `trainer` computes the very update `rollout` does (same gradients,
    bit for bit). A group of another adapter (pipelined): the first pass's ratio is still exactly 1, and the drift
    since it was sampled is the behaviour weight, reported as the stale deviation."""
    import dataclasses

    engine = DiffusersEngine(tiny_model_dir, dtype="float32", device="cpu")
    aio(engine.start())
    traj = aio(engine.generate(RolloutConfig(group_size=4, height=64, width=64, num_inference_steps=4).request(
        "a red sign", seed=3, group_id=0)))
    policy = Policy.from_pretrained(tiny_model_dir, lora_rank=4, lora_alpha=4, target_modules=TARGETS, shard=False)
    rollout_mode = TrainConfig(micro_batch_size=4, timestep_fraction=1.0, kl_beta=0.04)
    trainer_mode = dataclasses.replace(rollout_mode, old_logprob="trainer")
    ours, mismatch, grads = _one_pass(policy, trainer_mode, traj, policy_version=0)
    theirs, _, rollout_grads = _one_pass(policy, rollout_mode, traj, policy_version=0)
    assert ours["actor/ratio_dev_first_pass_max"] == theirs["actor/ratio_dev_first_pass_max"] == 0.0
    assert mismatch["rollout/logprob_mismatch_max"] == 0.0 and ours["actor/behaviour_weight_max"] == 1.0
    assert all(torch.equal(a, b) for a, b in zip(grads, rollout_grads, strict=True))

    # the policy moves on (another adapter): the group is one version stale
    from diffusers import QwenImageTransformer2DModel

    moved = random_lora(QwenImageTransformer2DModel.from_pretrained(tiny_model_dir, subfolder="transformer"),
                        version=1, rank=4, target_modules=TARGETS, seed=5, scale=0.05)
    policy = Policy.from_pretrained(tiny_model_dir, lora_rank=4, lora_alpha=4, target_modules=TARGETS, shard=False,
                                    adapter_tensors=moved.tensors)
    stale, _, _ = _one_pass(policy, trainer_mode, traj, policy_version=1)
    assert stale["actor/ratio_dev_first_pass_max"] == 0.0
    assert stale["actor/ratio_dev_stale_max"] > 0 and stale["actor/behaviour_weight_max"] != 1.0
    old_way, _, _ = _one_pass(policy, rollout_mode, traj, policy_version=1)
    assert old_way["actor/ratio_dev_stale_max"] == pytest.approx(stale["actor/ratio_dev_stale_max"], rel=1e-5)
