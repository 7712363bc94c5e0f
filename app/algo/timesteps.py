"""Which denoising steps of a group are trained (FlowGRPO's `timestep_fraction`): a pure function of the run's seed
and where the group is, so every rank and every restart draws the same ones."""

from __future__ import annotations

import numpy as np


def trained_steps(num_inference_steps: int, fraction: float, *, seed: int, step: int, group: int,
                  epoch: int) -> list[int]:
    """Which denoising steps of a group are trained: round(fraction·T) of them (at least one), drawn without
    replacement from a generator seeded by (seed, step, group, epoch); all of them when fraction = 1."""
    k = max(1, round(fraction * num_inference_steps))
    if k >= num_inference_steps:
        return list(range(num_inference_steps))
    rng = np.random.default_rng([seed, step, group, epoch])
    return sorted(int(i) for i in rng.choice(num_inference_steps, size=k, replace=False))
