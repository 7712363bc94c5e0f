"""The clipped FlowGRPO surrogate with a KL penalty to the reference policy.

Written from the FlowGRPO paper (eq. 6-8, itself the PPO/GRPO clipped objective applied to the denoising
MDP, one term per trained step):

    ρ = exp(log π_θ(x_next | x) − log π_old(x_next | x))
    L_clip = mean( max(−A·ρ, −A·clip(ρ, 1 − ε, 1 + ε)) )
    L = L_clip + β·KL(π_θ(·|x) ‖ π_ref(·|x))

Decoupled from the behaviour policy (Hilton et al. 2022, "Batch size-invariance for policy optimization"): when
the steps were sampled by a policy μ other than π_old (an older adapter, or the same adapter computed by another
graph: a compiled rollout), each term is weighed by w = min(π_old / μ, C), detached, and the ratio stays
π_θ / π_old:

    L_clip = mean( w · max(−A·ρ, −A·clip(ρ, 1 − ε, 1 + ε)) )

With π_old the policy as the step begins, scored by the training forward itself, ρ is exactly 1 on the first pass.

Both transitions are Gaussians with the same std s and means μ_θ, μ_ref, so the KL is exact and cheap:
KL = ||μ_θ − μ_ref||² / (2s²), averaged over the non-batch dims like the log-prob (`transition_kl`).
flow_grpo divides by its `std_dev_t`² (no sqrt(−dt) factor) instead; pass `SDEStepOutput.kl_std(True)` as `std`
to reproduce it (their β is tuned to that scale).
"""

from __future__ import annotations

import torch


def transition_kl(mean: torch.Tensor, ref_mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """KL(N(mean, s²) ‖ N(ref_mean, s²)) per element, averaged over non-batch dims.

    mean, ref_mean: [B, ...]; std: broadcastable to [B, ...] and > 0. Returns [B].
    """
    if bool((std <= 0).any()):
        raise ValueError("transition_kl needs std > 0: a deterministic step (noise_level 0) has no KL to train on")
    kl = (mean - ref_mean.detach()) ** 2 / (2 * std.detach() ** 2)  # [B, ...]
    return kl.mean(dim=tuple(range(1, kl.ndim)))  # [B]


def flow_grpo_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    *,
    clip_range: float,
    kl: torch.Tensor | None = None,
    kl_beta: float = 0.0,
    behaviour_log_prob: torch.Tensor | None = None,
    behaviour_weight_max: float = 2.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped surrogate (+ β·KL) over a batch of trained steps.

    log_prob: [B] or [B, T] under the current policy (differentiable); old_log_prob: same shape, from the policy
    that sampled the steps, or (with behaviour_log_prob) the proximal policy the ratio is taken against;
    advantages: [B] (one per sample, shared by its steps); kl: same shape as log_prob; behaviour_log_prob: same
    shape, the log-probs of the policy that sampled the steps: each term is weighed by
    min(exp(old − behaviour), behaviour_weight_max). Returns (scalar loss, metrics with detached floats under
    `actor/`).
    """
    if old_log_prob.shape != log_prob.shape:
        raise ValueError(f"old_log_prob {tuple(old_log_prob.shape)} must match log_prob {tuple(log_prob.shape)}")
    if advantages.shape != log_prob.shape[:1]:
        raise ValueError(f"advantages {tuple(advantages.shape)} must be [B] with B = {log_prob.shape[0]}")
    if clip_range <= 0:
        raise ValueError(f"clip_range={clip_range} must be > 0")
    adv = advantages.detach().reshape(-1, *([1] * (log_prob.ndim - 1)))  # [B, 1...]
    log_ratio = log_prob - old_log_prob.detach()  # [B(, T)]
    ratio = torch.exp(log_ratio)  # [B(, T)]
    unclipped = -adv * ratio  # [B(, T)]
    clipped = -adv * torch.clamp(ratio, 1 - clip_range, 1 + clip_range)  # [B(, T)]
    terms = torch.maximum(unclipped, clipped)  # [B(, T)]
    metrics = {}
    if behaviour_log_prob is not None:
        if behaviour_log_prob.shape != log_prob.shape:
            raise ValueError(f"behaviour_log_prob {tuple(behaviour_log_prob.shape)} must match log_prob "
                             f"{tuple(log_prob.shape)}")
        behaviour_log_ratio = (old_log_prob - behaviour_log_prob).detach()  # [B(, T)]
        raw = torch.exp(behaviour_log_ratio)
        weights = torch.clamp(raw, max=behaviour_weight_max)
        terms = weights * terms
        metrics.update({
            "actor/behaviour_weight_mean": float(weights.mean()),
            "actor/behaviour_weight_max": float(weights.max()),
            "actor/behaviour_weight_min": float(weights.min()),
            "actor/behaviour_weight_truncated": float((raw > behaviour_weight_max).float().mean()),
            "actor/behaviour_log_ratio_abs_max": float(behaviour_log_ratio.abs().max()),
            "actor/behaviour_ratio_dev_max": float((raw - 1).abs().max()),
        })
    policy_loss = terms.mean()
    loss = policy_loss
    if kl is not None:
        if kl.shape != log_prob.shape:
            raise ValueError(f"kl {tuple(kl.shape)} must match log_prob {tuple(log_prob.shape)}")
        kl_loss = kl.mean()
        loss = loss + kl_beta * kl_loss
        metrics["actor/kl"] = float(kl_loss.detach())
    with torch.no_grad():
        metrics.update({
            "actor/loss": float(loss),
            "actor/policy_loss": float(policy_loss),
            "actor/clipfrac": float(((ratio - 1).abs() > clip_range).float().mean()),
            "actor/approx_kl": float(0.5 * (log_ratio**2).mean()),
            "actor/ratio_mean": float(ratio.mean()),
            "actor/ratio_min": float(ratio.min()),
            "actor/ratio_max": float(ratio.max()),
            "actor/log_ratio_abs_max": float(log_ratio.abs().max()),  # on-policy check: 0 at the first pass
            "actor/ratio_dev_max": float((ratio - 1).abs().max()),
        })
    return loss, metrics
