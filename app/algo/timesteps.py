"""Which denoising steps of a group are trained (FlowGRPO's `timestep_fraction`): a pure function of the run's seed
and where the group is, so every rank and every restart draws the same ones."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def trained_steps(steps: int | Sequence[int], fraction: float, *, seed: int, step: int, group: int,
                  epoch: int) -> list[int]:
    """Which denoising steps of a group are trained: round(fraction·k) of its k stochastic steps (at least one),
    drawn without replacement from a generator seeded by (seed, step, group, epoch); all of them when fraction = 1.

    steps: the group's stochastic steps (`Trajectory.stochastic_steps`: its SDE window), or their number T when
    every step is stochastic (the steps 0..T−1)."""
    candidates = list(range(steps)) if isinstance(steps, int) else list(steps)
    k = max(1, round(fraction * len(candidates)))
    if k >= len(candidates):
        return candidates
    rng = np.random.default_rng([seed, step, group, epoch])
    return sorted(candidates[int(i)] for i in rng.choice(len(candidates), size=k, replace=False))
