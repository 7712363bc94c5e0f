"""SDE windows: where a group's stochastic steps go (random per group, fixed, sliding over training), which steps
take noise, and that a step outside the window is the ODE step with no density."""

import pytest
import torch

from app.algo.sde import sde_step
from app.algo.sde_window import noise_levels, place_window, stochastic_steps


def test_a_random_window_is_a_function_of_the_group_and_covers_every_start():
    starts = {place_window(10, 2, "random", seed=7, group=g, step=0)[0] for g in range(200)}
    assert starts == set(range(9))  # uniform over [0, T − w]: every start occurs, none past 8
    assert place_window(10, 2, "random", seed=7, group=3, step=0) == place_window(10, 2, "random", seed=7, group=3,
                                                                                  step=5)  # the step plays no part
    windows = [place_window(10, 2, "random", seed=s, group=3, step=0) for s in range(20)]
    assert len(set(windows)) > 1 and all(hi - lo == 2 for lo, hi in windows)


def test_a_random_window_within_a_range_stays_in_it():
    """Flow-GRPO-Fast's sde_window_range: a window of 2 in the steps [0, 5) of 10 starts at 0, 1, 2 or 3."""
    windows = {place_window(10, 2, "random", seed=7, group=g, step=0, within=(0, 5)) for g in range(200)}
    assert windows == {(0, 2), (1, 3), (2, 4), (3, 5)}
    with pytest.raises(ValueError, match="within=\\(3, 4\\)"):
        place_window(10, 2, "random", seed=0, group=0, step=0, within=(3, 4))


def test_a_fixed_window_is_the_same_for_every_group_and_must_fit():
    assert {place_window(10, 3, "fixed", seed=0, group=g, step=g, start=4) for g in range(5)} == {(4, 7)}
    with pytest.raises(ValueError, match="starts at 7 at the latest"):
        place_window(10, 3, "fixed", seed=0, group=0, step=0, start=8)


def test_a_sliding_window_moves_every_few_steps_and_stays_at_the_end():
    starts = [place_window(6, 2, "sliding", seed=0, group=0, step=s, every=2, stride=1)[0] for s in range(12)]
    assert starts == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 4, 4]


def test_a_window_as_long_as_the_trajectory_is_the_whole_trajectory():
    assert place_window(4, 9, "random", seed=1, group=2, step=0) == (0, 4)
    assert noise_levels(0.7, 4, None) == [0.7] * 4 and stochastic_steps(4, None) == [0, 1, 2, 3]


def test_only_the_window_takes_noise_and_carries_a_density():
    assert noise_levels(0.7, 5, (1, 3)) == [0.0, 0.7, 0.7, 0.0, 0.0]
    assert stochastic_steps(5, (1, 3)) == [1, 2]
    # outside the window: the ODE step, deterministic, with no density (log-prob 0, never trained)
    g = torch.Generator().manual_seed(0)
    x, v = torch.randn(2, 4, 8, generator=g), torch.randn(2, 4, 8, generator=g)
    ode = sde_step(v, x, 0.6, 0.4, noise_level=0.0, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(ode.prev_sample, x + (0.4 - 0.6) * v, rtol=0, atol=1e-6)
    assert torch.equal(ode.log_prob, torch.zeros(2))


@pytest.mark.parametrize("bad", [dict(placement="cyclic"), dict(size=0), dict(every=0), dict(start=-1)])
def test_bad_window_settings_are_refused(bad):
    args = dict(num_steps=10, size=2, placement="random", seed=0, group=0, step=0) | bad
    with pytest.raises(ValueError):
        place_window(**args)
