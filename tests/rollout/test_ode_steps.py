"""`rollout.ode_steps`: First Block Cache on the ODE steps outside the SDE window (app/rollout/ode_steps.py), on the
diffusers engines and the tiny models. The window's steps are untouched: their transitions and log-probs are bit for
bit the full computation's and the trainer's; the cache restarts after every window step; each CFG forward keeps its
own cache; a threshold nothing falls under changes nothing; the config refuses what it cannot do, naming the field."""

import pytest
import torch

from app.config import ConfigError, load
from app.models.qwen_image import FAMILY as QWEN
from app.types import GenerationRequest

HUGE = 1e9  # every ODE step after a full one reuses its residual
TINY = 1e-12  # no ODE step does


def request(**changes) -> GenerationRequest:
    fields = dict(prompt='a sign that says "OPEN"', n=2, height=64, width=64, num_inference_steps=4,
                  noise_level=0.7, sde_type="sde", seed=7)
    return GenerationRequest(**(fields | changes))


def sample(engine, aio, req, threshold):
    engine.ode_cache_threshold = threshold
    try:
        return aio(engine.generate(req))
    finally:
        engine.ode_cache_threshold = None


def test_ode_steps_leave_the_window_exact_and_cache_the_steps_after_it(diffusers_engine, aio, tiny_model_dir):
    req = request(sde_window=(0, 2))  # steps 0, 1 stochastic; 2, 3 the ODE
    full, cached = sample(diffusers_engine, aio, req, None), sample(diffusers_engine, aio, req, HUGE)
    # the window's transitions and the first ODE step (nothing cached yet) are the full computation's, bit for bit
    assert torch.equal(cached.latents[:, :4], full.latents[:, :4]) and torch.equal(cached.log_probs, full.log_probs)
    assert not torch.equal(cached.latents[:, 4], full.latents[:, 4])  # step 3 reused step 2's blocks
    assert cached.producer["ode_forwards"] == 2 and cached.producer["ode_forwards_cached"] == 1
    assert "ode_forwards" not in full.producer
    trainer = QWEN.load_denoiser(tiny_model_dir, dtype=torch.float32, device=torch.device("cpu")).eval()
    with torch.no_grad():
        scored = QWEN.score_trajectory(trainer, cached, range(2), range(2))
    assert torch.equal(torch.stack([s.log_prob for s in scored], dim=1), cached.log_probs[:, :2])


def test_ode_steps_cache_restarts_after_every_window_step(diffusers_engine, aio):
    """A window in the middle: the ODE step before it and the one after it are each the first of their run, so
    nothing is reused even at a threshold everything falls under."""
    req = request(sde_window=(1, 3))
    full, cached = sample(diffusers_engine, aio, req, None), sample(diffusers_engine, aio, req, HUGE)
    assert torch.equal(cached.latents, full.latents) and torch.equal(cached.log_probs, full.log_probs)
    assert cached.producer["ode_forwards"] == 2 and cached.producer["ode_forwards_cached"] == 0


def test_ode_steps_under_a_threshold_nothing_meets_change_nothing(diffusers_engine, aio):
    req = request(sde_window=(0, 1))
    full, cached = sample(diffusers_engine, aio, req, None), sample(diffusers_engine, aio, req, TINY)
    assert torch.equal(cached.latents, full.latents) and torch.equal(cached.images, full.images)
    assert cached.producer["ode_forwards"] == 3 and cached.producer["ode_forwards_cached"] == 0


@pytest.mark.slow
def test_ode_steps_keep_a_cache_per_cfg_forward(wan_engine, aio):
    """Wan runs its CFG branches as two forwards a step: each compares with its own last full residual, so at a
    threshold everything falls under the second ODE step's two forwards are cached and the first step's are not
    (one shared cache would have let the first step's second forward reuse the first forward's blocks)."""
    req = request(sde_window=(0, 2), num_frames=5, guidance_scale=3.0, negative_prompt=" ")
    full, cached = sample(wan_engine, aio, req, None), sample(wan_engine, aio, req, HUGE)
    assert cached.producer["ode_forwards"] == 4 and cached.producer["ode_forwards_cached"] == 2
    assert torch.equal(cached.latents[:, :4], full.latents[:, :4]) and torch.equal(cached.log_probs, full.log_probs)


def test_ode_steps_config_refuses_what_it_cannot_do():
    base = ["rollout.engine=diffusers", "rollout.sde_window.size=2", "rollout.ode_steps.cache=first_block"]
    assert load("configs/tiny_cpu.yaml", base).rollout.ode_steps.threshold == 0.05
    for changes, message in (
            (["rollout.ode_steps.cache=teacache"], "rollout.ode_steps.cache='teacache': use one of"),
            (["rollout.ode_steps.threshold=0"], "rollout.ode_steps.threshold=0.0 must be > 0"),
            (["rollout.engine=vllm_omni"], "rollout.engine=vllm_omni does not: use rollout.engine=diffusers"),
            (["rollout.sde_window.size=0"], "every step is an SDE step")):
        with pytest.raises(ConfigError, match=message):
            load("configs/tiny_cpu.yaml", base + changes)
    assert load("configs/tiny_cpu.yaml").rollout.ode_steps.cache == "off"  # off by default
