"""Where a group's SDE noise goes (Flow-GRPO-Fast, MixGRPO): only a window of w consecutive denoising steps is
sampled with the SDE (η = the noise level); the other steps take the deterministic ODE step (η = 0). Only the
window's steps have a density, so only they are trained: the training cost falls by T / w.

The window of a group is [start, start + w), placed by one of:

    random   start drawn uniformly per group, from (seed, group), so that the window lies in the steps
             [lo, hi) (the whole trajectory by default; Flow-GRPO-Fast and verl-omni's Qwen-Image recipe keep it
             in the first half, where the image's layout is decided: `sde_window_range` there)  (Flow-GRPO-Fast)
    fixed    start = `start` for every group
    sliding  start = min(`start` + (step // every) · stride, T − w): the window moves from the noisy end of the
             trajectory towards the clean end as training proceeds, and stays at the end    (MixGRPO)

A pure function of where the group is in the run (seed, its global index, its training step), so every rank,
replica and restart places it alike. Ray-free and config-free: plain arguments.
"""

from __future__ import annotations

import numpy as np

PLACEMENTS = ("random", "fixed", "sliding")  # declared here only: app.config.WindowPlacement is built from it


def place_window(num_steps: int, size: int, placement: str, *, seed: int, group: int, step: int, start: int = 0,
                 every: int = 1, stride: int = 1, within: tuple[int, int] | None = None) -> tuple[int, int]:
    """The SDE window (first step, one past the last) of a group of `num_steps` denoising steps. within: the
    steps [lo, hi) a random window lies in (None: all of them)."""
    if placement not in PLACEMENTS:
        raise ValueError(f"placement={placement!r} is not one of {PLACEMENTS}")
    if size < 1:
        raise ValueError(f"size={size}: a window holds at least one step")
    if start < 0 or every < 1 or stride < 0:
        raise ValueError(f"start={start}, every={every}, stride={stride}: need start >= 0, every >= 1, stride >= 0")
    size = min(size, num_steps)
    last = num_steps - size  # the latest start that keeps the window inside the trajectory
    if placement == "random":
        lo, hi = within if within is not None else (0, num_steps)
        if not 0 <= lo < hi <= num_steps or hi - lo < size:
            raise ValueError(f"within={within}: a window of {size} of {num_steps} steps needs 0 <= lo, "
                             f"lo + {size} <= hi <= {num_steps}")
        first = int(np.random.default_rng([seed, group]).integers(lo, hi - size + 1))
    elif placement == "fixed":
        if start > last:
            raise ValueError(f"start={start}: a window of {size} of {num_steps} steps starts at {last} at the latest")
        first = start
    else:
        first = min(start + (step // every) * stride, last)
    return first, first + size


def noise_levels(noise_level: float, num_steps: int, window: tuple[int, int] | None) -> list[float]:
    """η of each denoising step: the noise level inside the window (everywhere without one), 0 outside."""
    lo, hi = window if window is not None else (0, num_steps)
    return [noise_level if lo <= i < hi else 0.0 for i in range(num_steps)]


def stochastic_steps(num_steps: int, window: tuple[int, int] | None) -> list[int]:
    """The steps that carry a density (and may be trained): the window's, or all of them without one."""
    lo, hi = window if window is not None else (0, num_steps)
    return list(range(lo, hi))
