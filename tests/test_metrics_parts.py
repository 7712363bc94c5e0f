"""The run's numbers before they are logged: weighted means and extremes, phase timing."""

import time

import pytest

from app.metrics import PhaseTimer, Stats, throughput


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
    time.sleep(0.01)  # outside every phase
    out = timer.metrics()
    assert set(out) == {"timing/rollout_s", "timing/step_s", "timing/other_s"}
    assert 0.02 <= out["timing/rollout_s"] <= out["timing/step_s"] and out["timing/other_s"] >= 0.01
    assert out["timing/rollout_s"] + out["timing/other_s"] == pytest.approx(out["timing/step_s"])


def test_throughput_and_mfu_of_a_step():
    step = {"rollout/images": 32.0, "timing/step_s": 4.0}
    assert throughput(step, useful_tflop=989.0, gpus=2) == {
        "perf/images_per_s": 8.0, "perf/useful_tflop": 989.0, "perf/images_per_s_per_gpu": 4.0,
        "perf/mfu": pytest.approx(989e12 / (2 * 989e12 * 4.0))}
    assert set(throughput(step, useful_tflop=1.0, gpus=0)) == {"perf/images_per_s", "perf/useful_tflop"}
