"""The loop's small parts: which timesteps are trained, how metrics are averaged, what a rollout request asks."""

from pathlib import Path

import pytest

from app.config import load
from app.train.loop import Stats, rollout_request, trained_steps

REPO_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "tiny_cpu.yaml"


@pytest.mark.parametrize("fraction, expected", [(1.0, 10), (0.5, 5), (0.24, 2), (0.01, 1)])
def test_trained_steps_count_and_reproducibility(fraction, expected):
    steps = trained_steps(10, fraction, seed=0, step=3, group=5, epoch=0)
    assert len(steps) == expected and steps == sorted(set(steps)) and all(0 <= i < 10 for i in steps)
    assert steps == trained_steps(10, fraction, seed=0, step=3, group=5, epoch=0)
    if expected < 10:  # other groups/steps/passes draw other subsets (over enough draws)
        draws = {tuple(trained_steps(10, fraction, seed=0, step=s, group=g, epoch=0)) for s in range(4)
                 for g in range(4)}
        assert len(draws) > 1


def test_stats_weighted_means_and_extremes():
    stats = Stats()
    stats.add({"actor/loss": 1.0, "actor/ratio_max": 1.1, "actor/ratio_min": 0.9}, weight=1)
    stats.add({"actor/loss": 4.0, "actor/ratio_max": 1.3, "actor/ratio_min": 0.95}, weight=3)
    assert stats.result() == {"actor/loss": pytest.approx(13 / 4), "actor/ratio_max": 1.3, "actor/ratio_min": 0.9}


def test_rollout_request_follows_the_config_and_seeds_per_group():
    cfg = load(REPO_CONFIG)
    a, b = rollout_request(cfg, 'a sign "A"', 0), rollout_request(cfg, 'a sign "A"', 1)
    assert (a.n, a.height, a.num_inference_steps, a.noise_level) == (cfg.rollout.group_size, cfg.rollout.height,
                                                          cfg.rollout.num_inference_steps, cfg.rollout.noise_level)
    assert a.seed != b.seed and a.group_id == 0 and a.negative_prompt is None
    cfg_cfg = load(REPO_CONFIG, ["rollout.guidance_scale=4.0"])
    assert rollout_request(cfg_cfg, "x", 0).negative_prompt == cfg_cfg.rollout.negative_prompt
