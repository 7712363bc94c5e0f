"""Group-relative advantages (GRPO): normalise each reward against the other samples of its prompt group.

    A_i = clip((r_i − mean_g(i)) / (std + eps), −clip_max, +clip_max)

where mean_g is the mean reward of sample i's group and std is either that group's std ("group", GRPO) or the
std of the whole batch ("batch", FlowGRPO's `global_std` option, which keeps small-spread groups from being
blown up). Stds are population stds (ddof = 0), as in FlowGRPO. A group whose rewards are all equal carries no
signal: its advantages are exactly 0, and the fraction of such groups is reported (`adv/zero_std_frac`).
"""

from __future__ import annotations

import torch

STD_MODES = ("group", "batch")


def group_advantages(
    rewards: torch.Tensor,
    group_index: torch.Tensor,
    *,
    std_mode: str = "group",
    eps: float = 1e-4,
    clip_max: float | None = 5.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Advantages for a flat batch of rewards.

    rewards: [N] float; group_index: [N] integer id of each sample's prompt group (any ids; groups may differ in
    size and need not be contiguous). Returns (advantages [N] fp32, metrics).
    """
    if std_mode not in STD_MODES:
        raise ValueError(f"std_mode={std_mode!r} is not one of {STD_MODES}")
    if rewards.ndim != 1 or group_index.shape != rewards.shape:
        raise ValueError(f"rewards {tuple(rewards.shape)} and group_index {tuple(group_index.shape)} must both be [N]")
    if eps <= 0:
        raise ValueError(f"eps={eps} must be > 0")
    if clip_max is not None and clip_max <= 0:
        raise ValueError(f"clip_max={clip_max} must be > 0 (or None for no clipping)")
    r = rewards.double()  # [N] float64: group sums of many rewards stay exact enough
    _, group = torch.unique(group_index, return_inverse=True)  # [N] in 0..G-1
    num_groups = int(group.max()) + 1
    count = torch.zeros(num_groups, dtype=r.dtype).index_add_(0, group, torch.ones_like(r))  # [G]
    mean = torch.zeros(num_groups, dtype=r.dtype).index_add_(0, group, r) / count  # [G]
    centred = r - mean[group]  # [N]
    group_var = torch.zeros(num_groups, dtype=r.dtype).index_add_(0, group, centred**2) / count  # [G]
    group_std = group_var.sqrt()  # [G]
    zero_std = group_std <= 1e-12 * (1 + mean.abs())  # [G] all rewards equal (up to rounding)

    std = group_std[group] if std_mode == "group" else r.std(correction=0).expand_as(r)  # [N]
    adv = centred / (std + eps)  # [N]
    adv = torch.where(zero_std[group], torch.zeros_like(adv), adv)  # [N] no signal from a flat group
    if clip_max is not None:
        adv = adv.clamp(-clip_max, clip_max)
    metrics = {
        "adv/zero_std_frac": float(zero_std.double().mean()),
        "adv/abs_mean": float(adv.abs().mean()),
        "adv/clip_frac": float((adv.abs() >= clip_max).double().mean()) if clip_max is not None else 0.0,
        "reward/group_std_mean": float(group_std.mean()),
    }
    return adv.float(), metrics


def step_advantages(totals: dict[int, list[float]], *, std_mode: str = "group",
                    clip_max: float = 5.0) -> tuple[dict[int, torch.Tensor], dict[str, float]]:
    """A step's advantages from every group's total rewards ({group id: [n] rewards}, all workers' groups): {group id:
    [n] advantages} normalised per group over the whole batch (`group_advantages`), and its metrics."""
    ids = sorted(totals)
    rewards = torch.tensor([totals[g] for g in ids], dtype=torch.float64)  # [G, n]
    group_index = torch.tensor(ids).repeat_interleave(rewards.shape[1])  # [G·n]
    flat, metrics = group_advantages(rewards.flatten(), group_index, std_mode=std_mode, clip_max=clip_max)
    return {g: flat.view(len(ids), -1)[k] for k, g in enumerate(ids)}, metrics
