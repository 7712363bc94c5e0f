"""Which denoising steps of a group are trained: how many, always the same ones for the same group, others elsewhere."""

import pytest

from app.algo.timesteps import trained_steps


@pytest.mark.parametrize("fraction, expected", [(1.0, 10), (0.5, 5), (0.24, 2), (0.01, 1)])
def test_trained_steps_count_and_reproducibility(fraction, expected):
    steps = trained_steps(10, fraction, seed=0, step=3, group=5, epoch=0)
    assert len(steps) == expected and steps == sorted(set(steps)) and all(0 <= i < 10 for i in steps)
    assert steps == trained_steps(10, fraction, seed=0, step=3, group=5, epoch=0)
    if expected < 10:  # other groups/steps/passes draw other subsets (over enough draws)
        draws = {tuple(trained_steps(10, fraction, seed=0, step=s, group=g, epoch=0)) for s in range(4)
                 for g in range(4)}
        assert len(draws) > 1


def test_with_an_sde_window_only_its_steps_are_trained():
    window = [3, 4, 5, 6]
    assert trained_steps(window, 1.0, seed=0, step=1, group=2, epoch=0) == window
    draws = {tuple(trained_steps(window, 0.5, seed=0, step=s, group=g, epoch=0)) for s in range(4) for g in range(4)}
    assert all(len(d) == 2 and set(d) <= set(window) for d in draws) and len(draws) > 1
    # the whole trajectory as a list draws what its length does: no window changes nothing
    assert trained_steps(list(range(10)), 0.3, seed=0, step=3, group=5, epoch=1) == trained_steps(
        10, 0.3, seed=0, step=3, group=5, epoch=1)
