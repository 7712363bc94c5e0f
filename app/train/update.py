"""The policy update of one FlowGRPO step, free of Ray: what the Ray Train loop (app/train/loop.py) and the
single-process baseline (jobs/baseline_single_gpu.py) both run.

`train_pass` is one pass over a batch of sampled groups: `train.timestep_fraction` of each group's denoising
steps, in micro-batches of one group's images, the clipped FlowGRPO loss (+ β·KL to the adapter-free reference)
backpropagated, gradients clipped, one optimizer step. Every term weighs the same: the loss is the mean over the
batch's (image, trained step) terms.

Old log-probs (`train.old_logprob`): the rollout's, recomputed before the update, or the first pass's own
("trainer"). The last is free and exact under torch.compile, whose grad and no-grad graphs differ in the last
bits: the first pass's ratio is then exactly 1 for every group, and the rollout's log-probs (the behaviour policy's:
an older adapter when pipelined, another graph when compiled) weigh each term instead (app/algo/loss.py).
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


def make_optimizer(policy: Policy, train: TrainConfig) -> torch.optim.Optimizer:
    """AdamW over the LoRA parameters; its fused CUDA kernel on a GPU (`train.fused_optimizer`): one launch for
    every tensor instead of a handful per tensor."""
    params = policy.parameters()
    fused = train.fused_optimizer and params[0].device.type == "cuda"
    return torch.optim.AdamW(params, lr=train.learning_rate, weight_decay=train.weight_decay,
                             **({"fused": True} if fused else {}))


def train_pass(policy: Policy, optimizer: torch.optim.Optimizer, train: TrainConfig, *, step: int, epoch: int,
               trajectories: Sequence[Trajectory], advantages: Sequence[torch.Tensor], old: Sequence[torch.Tensor],
               stats: Stats, mismatch: Stats, policy_version: int | None = None) -> float:
    """One optimizer step over the groups; `advantages[g]` [n] and `old[g]` [n, T] belong to `trajectories[g]`.
    policy_version: the adapter version the policy had when the step began; a group sampled by an earlier one
    (pipelined training) is weighed by its own log-probs (the ratio against them, or with old_logprob=trainer the
    behaviour weight), which measure how far the policy has moved since, not a mismatch
    (`actor/ratio_dev_stale_max`). None: every group is the policy's. With old_logprob=trainer `old` is unread.
    Returns the gradient norm before clipping."""
    optimizer.zero_grad(set_to_none=True)
    own = train.old_logprob == "trainer"  # the first pass scores its own old log-probs
    for traj, adv, old_lp in zip(trajectories, advantages, old, strict=True):
        steps = trained_steps(traj.stochastic_steps, train.timestep_fraction, seed=train.seed, step=step,
                              group=traj.group_id, epoch=epoch)
        weight = 1.0 / (len(trajectories) * traj.group_size * len(steps))  # loss = mean over the batch's terms
        stale = policy_version not in (None, traj.lora_version)
        for start in range(0, traj.group_size, train.micro_batch_size):
            samples = list(range(start, start + train.micro_batch_size))
            for i in steps:
                loss, terms = step_loss(policy, train, traj, i, samples, adv[samples],
                                        None if own else old_lp[samples, i],
                                        behaviour_lp=traj.log_probs[samples, i] if own else None)
                (loss * weight * len(samples)).backward()
                stats.add(terms, len(samples))
                if epoch == 0:
                    checks, mismatched = first_pass_checks(train, terms, stale=stale)
                    stats.add(checks)
                    mismatch.add(mismatched)
    norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), train.max_grad_norm)
    optimizer.step()
    return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)  # a DTensor under FSDP2


def first_pass_checks(train: TrainConfig, terms: dict[str, float], *, stale: bool) -> tuple[dict, dict]:
    """(checks, mismatch) of one micro-step of the first pass. `actor/ratio_dev_first_pass_max`: how far the
    ratio is from 1 where nothing has been updated yet (0 exactly when the trainer scores what the rollout did, or
    scores its own old log-probs); `actor/ratio_dev_stale_max`: for a group of an older adapter, how far the policy
    has moved since (π_θ / π_rollout − 1); `rollout/logprob_mismatch_max`: |log π_trainer − log π_rollout| for a
    group of the policy's own version."""
    if train.old_logprob == "trainer":  # the ratio is against the policy itself; the rollout is the behaviour
        checks = {"actor/ratio_dev_first_pass_max": terms["actor/ratio_dev_max"]}
        if stale:
            return {**checks, "actor/ratio_dev_stale_max": terms["actor/behaviour_ratio_dev_max"]}, {}
        return checks, {"rollout/logprob_mismatch_max": terms["actor/behaviour_log_ratio_abs_max"]}
    if stale:
        return {"actor/ratio_dev_stale_max": terms["actor/ratio_dev_max"]}, {}
    mismatched = {"rollout/logprob_mismatch_max": terms["actor/log_ratio_abs_max"]}
    return {"actor/ratio_dev_first_pass_max": terms["actor/ratio_dev_max"]}, (
        mismatched if train.old_logprob == "rollout" else {})


def step_loss(policy: Policy, train: TrainConfig, traj: Trajectory, i: int, samples: list[int], adv: torch.Tensor,
              old_lp: torch.Tensor | None, behaviour_lp: torch.Tensor | None = None):
    """Clipped FlowGRPO loss (+ β·KL to the adapter-free reference) of step i for some members of a group.
    old_lp None: this forward's own log-probs, detached (the policy as it stands is the old one); behaviour_lp:
    the log-probs of the policy that sampled the step, weighing the term (decoupled, app/algo/loss.py)."""
    (out,) = policy.score(traj, [i], samples, flow_grpo_compat=train.flow_grpo_compat)
    if old_lp is None:
        old_lp = out.log_prob.detach()
    kl = None
    if train.kl_beta > 0:
        with torch.no_grad(), policy.reference():
            (ref,) = policy.score(traj, [i], samples, flow_grpo_compat=train.flow_grpo_compat)
        kl = transition_kl(out.prev_sample_mean, ref.prev_sample_mean, out.kl_std(train.flow_grpo_compat))
    return flow_grpo_loss(out.log_prob, old_lp.to(out.log_prob), adv.to(out.log_prob), clip_range=train.clip_range,
                          kl=kl, kl_beta=train.kl_beta,
                          behaviour_log_prob=None if behaviour_lp is None else behaviour_lp.to(out.log_prob),
                          behaviour_weight_max=train.behaviour_weight_max)


def recompute_log_probs(policy: Policy, train: TrainConfig, trajectories: Sequence[Trajectory], mismatch: Stats, *,
                        step: int) -> list[torch.Tensor]:
    """Old log-probs [n, T] per group from the current policy, at the steps some pass of this optimizer step trains
    (`trained_steps` of every epoch; the others keep the rollout's, which nothing reads); logs how far the rollout's
    own are from them. With 2 of 10 steps trained, each pass adds a fifth of scoring every step. A compiled policy
    scores them through the graph it trains with (gradients on, then dropped): its no-grad graph differs in the
    last bits, and the first pass's ratio would not be 1.

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
            for i in steps:  # one at a time: with gradients on, a step's graph is dropped before the next
                with torch.set_grad_enabled(policy.compiled):
                    (scored,) = policy.score(traj, [i], samples, flow_grpo_compat=train.flow_grpo_compat)
                lp[samples[0]:samples[-1] + 1, i] = scored.log_prob.detach().float().cpu()
        mismatch.add({"rollout/logprob_mismatch_max": float((lp - traj.log_probs).abs().max())})
        out.append(lp)
    return out
