"""The policy update of one FlowGRPO step, free of Ray: what the Ray Train loop (app/train/loop.py) and the
single-process baseline (jobs/baseline_single_gpu.py) both run.

`train_pass` is one pass over a batch of sampled groups: `train.timestep_fraction` of each group's denoising
steps, in micro-batches of one group's images, the clipped FlowGRPO loss (+ β·KL to the adapter-free reference)
backpropagated, gradients clipped, one optimizer step. Every term weighs the same: the loss is the mean over the
batch's (image, trained step) terms.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from app.algo.loss import flow_grpo_loss, transition_kl
from app.algo.timesteps import trained_steps
from app.config import TrainConfig
from app.metrics import Stats
from app.train.policy import Policy
from app.types import Trajectory


def train_pass(policy: Policy, optimizer: torch.optim.Optimizer, train: TrainConfig, *, step: int, epoch: int,
               trajectories: Sequence[Trajectory], advantages: Sequence[torch.Tensor], old: Sequence[torch.Tensor],
               stats: Stats, mismatch: Stats, policy_version: int | None = None) -> float:
    """One optimizer step over the groups; `advantages[g]` [n] and `old[g]` [n, T] belong to `trajectories[g]`.
    policy_version: the adapter version the policy had when the step began; a group sampled by an earlier one
    (pipelined training) is scored against its own log-probs, and its first-pass ratio measures how far the
    policy has moved since, not a mismatch (`actor/ratio_dev_stale_max`). None: every group is the policy's.
    Returns the gradient norm before clipping."""
    optimizer.zero_grad(set_to_none=True)
    for traj, adv, old_lp in zip(trajectories, advantages, old, strict=True):
        steps = trained_steps(traj.stochastic_steps, train.timestep_fraction, seed=train.seed, step=step,
                              group=traj.group_id, epoch=epoch)
        weight = 1.0 / (len(trajectories) * traj.group_size * len(steps))  # loss = mean over the batch's terms
        for start in range(0, traj.group_size, train.micro_batch_size):
            samples = list(range(start, start + train.micro_batch_size))
            for i in steps:
                loss, terms = step_loss(policy, train, traj, i, samples, adv[samples], old_lp[samples, i])
                (loss * weight * len(samples)).backward()
                stats.add(terms, len(samples))
                if epoch == 0 and policy_version not in (None, traj.lora_version):
                    stats.add({"actor/ratio_dev_stale_max": terms["actor/ratio_dev_max"]})
                elif epoch == 0:  # nothing has been updated yet: the trainer must score what the rollout did
                    stats.add({"actor/ratio_dev_first_pass_max": terms["actor/ratio_dev_max"]})
                    if train.old_logprob == "rollout":
                        mismatch.add({"rollout/logprob_mismatch_max": terms["actor/log_ratio_abs_max"]})
    norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), train.max_grad_norm)
    optimizer.step()
    return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)  # a DTensor under FSDP2


def step_loss(policy: Policy, train: TrainConfig, traj: Trajectory, i: int, samples: list[int], adv: torch.Tensor,
              old_lp: torch.Tensor):
    """Clipped FlowGRPO loss (+ β·KL to the adapter-free reference) of step i for some members of a group."""
    (out,) = policy.score(traj, [i], samples, flow_grpo_compat=train.flow_grpo_compat)
    kl = None
    if train.kl_beta > 0:
        with torch.no_grad(), policy.reference():
            (ref,) = policy.score(traj, [i], samples, flow_grpo_compat=train.flow_grpo_compat)
        kl = transition_kl(out.prev_sample_mean, ref.prev_sample_mean, out.kl_std(train.flow_grpo_compat))
    return flow_grpo_loss(out.log_prob, old_lp.to(out.log_prob), adv.to(out.log_prob), clip_range=train.clip_range,
                          kl=kl, kl_beta=train.kl_beta)


@torch.no_grad()
def recompute_log_probs(policy: Policy, train: TrainConfig, trajectories: Sequence[Trajectory], mismatch: Stats, *,
                        step: int) -> list[torch.Tensor]:
    """Old log-probs [n, T] per group from the current policy, at the steps some pass of this optimizer step trains
    (`trained_steps` of every epoch; the others keep the rollout's, which nothing reads); logs how far the rollout's
    own are from them. With 2 of 10 steps trained, each pass adds a fifth of scoring every step.

    Each epoch's steps are scored as a list of their own, repeats included: every rank then runs the same number of
    forwards (FSDP2's collectives need that), which the union of the epochs' steps would not (its size varies by
    group)."""
    out = []
    for traj in trajectories:
        steps = [i for epoch in range(train.num_inner_epochs)
                 for i in trained_steps(traj.stochastic_steps, train.timestep_fraction, seed=train.seed,
                                        step=step, group=traj.group_id, epoch=epoch)]
        lp = traj.log_probs.clone()
        for start in range(0, traj.group_size, train.micro_batch_size):
            samples = list(range(start, start + train.micro_batch_size))
            scored = policy.score(traj, steps, samples, flow_grpo_compat=train.flow_grpo_compat)
            lp[samples[0]:samples[-1] + 1, steps] = torch.stack([o.log_prob.float().cpu() for o in scored], dim=1)
        mismatch.add({"rollout/logprob_mismatch_max": float((lp - traj.log_probs).abs().max())})
        out.append(lp)
    return out
