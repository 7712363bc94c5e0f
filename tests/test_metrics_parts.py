"""The run's numbers before they are logged: weighted means and extremes, phase timing."""

import time

import pytest

from app.metrics import PhaseTimer, Stats


def test_stats_weighted_means_and_extremes():
    stats = Stats()
    stats.add({"actor/loss": 1.0, "actor/ratio_max": 1.1, "actor/ratio_min": 0.9}, weight=1)
    stats.add({"actor/loss": 4.0, "actor/ratio_max": 1.3, "actor/ratio_min": 0.95}, weight=3)
    assert stats.result() == {"actor/loss": pytest.approx(13 / 4), "actor/ratio_max": 1.3, "actor/ratio_min": 0.9}


def test_phase_timer_adds_up_a_phase_entered_twice():
    timer = PhaseTimer()
    with timer("rollout"):
        time.sleep(0.01)
    with timer("rollout"):
        time.sleep(0.01)
    out = timer.metrics()
    assert set(out) == {"timing/rollout_s", "timing/step_s"}
    assert 0.02 <= out["timing/rollout_s"] <= out["timing/step_s"]
