"""What a rollout request of the training loop asks for."""

from pathlib import Path

from app.config import load
from app.train.loop import rollout_request

REPO_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "tiny_cpu.yaml"


def test_rollout_request_follows_the_config_and_seeds_per_group():
    cfg = load(REPO_CONFIG)
    a, b = rollout_request(cfg, 'a sign "A"', 0), rollout_request(cfg, 'a sign "A"', 1)
    assert (a.n, a.height, a.num_inference_steps, a.noise_level) == (cfg.rollout.group_size, cfg.rollout.height,
                                                          cfg.rollout.num_inference_steps, cfg.rollout.noise_level)
    assert a.seed != b.seed and a.group_id == 0 and a.negative_prompt is None
    cfg_cfg = load(REPO_CONFIG, ["rollout.guidance_scale=4.0"])
    assert rollout_request(cfg_cfg, "x", 0).negative_prompt == cfg_cfg.rollout.negative_prompt
