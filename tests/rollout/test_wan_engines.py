"""Wan rollouts on the diffusers engine and the tiny Wan: a group is N videos ([n, F, H, W, 3] frames, fp32 video
latents [n, T+1, C, F', h, w]); seeds reproduce a group whatever the batching; the trainer's log-probs equal the
rollout's bit for bit with and without CFG and a LoRA; noise_level 0 is diffusers' own WanPipeline; a request
without frames is refused naming the field."""

import pytest
import torch

from app.models.lora import random_lora
from app.models.wan import FAMILY
from app.types import GenerationRequest, RequestError


def request(**changes) -> GenerationRequest:
    fields = dict(prompt='a sign that says "OPEN"', n=3, height=64, width=64, num_frames=9, num_inference_steps=4,
                  noise_level=0.7, sde_type="sde", seed=7)
    if changes.get("guidance_scale", 1.0) > 1:
        fields["negative_prompt"] = " "
    return GenerationRequest(**(fields | changes))


@pytest.fixture(scope="module")
def trainer_transformer(tiny_wan_dir):
    return FAMILY.load_denoiser(tiny_wan_dir, dtype=torch.float32, device=torch.device("cpu")).eval()


@pytest.fixture(scope="module")
def lora_v2(tiny_wan_dir):
    transformer = FAMILY.load_denoiser(tiny_wan_dir, dtype=torch.float32, device=torch.device("cpu"))
    return random_lora(transformer, version=2, rank=4, target_modules=list(FAMILY.lora_targets), seed=0, scale=0.5)


def scored(transformer, traj) -> torch.Tensor:
    with torch.no_grad():
        steps = FAMILY.score_trajectory(transformer, traj, range(traj.num_inference_steps), range(traj.group_size))
    return torch.stack([s.log_prob for s in steps], dim=1)  # [n, T]


def test_a_group_is_n_videos_with_every_step_recorded(wan_engine, aio):
    traj = aio(wan_engine.generate(request(group_id=5, guidance_scale=3.0)))
    n, t = 3, 4
    assert traj.family == "wan" and traj.group_id == 5 and traj.num_frames == 9 and traj.is_video
    assert traj.images.shape == (n, 9, 64, 64, 3) and traj.images.dtype == torch.uint8
    assert traj.latents.shape == (n, t + 1, 16, 3, 8, 8) and traj.latents.dtype == torch.float32
    assert traj.sigmas[0] == 1 and traj.sigmas[-1] == 0 and torch.allclose(traj.timesteps, traj.sigmas[:-1] * 1000)
    assert traj.prompt_embeds.shape == (512, 32) and traj.negative_prompt_embeds.shape == (512, 32)
    assert not torch.equal(traj.images[0, 0], traj.images[0, -1])  # frames differ: a video, not a still


def test_same_seed_reproduces_the_group_in_either_batching(wan_engine, aio):
    a, b = aio(wan_engine.generate(request())), aio(wan_engine.generate(request()))
    assert torch.equal(a.latents, b.latents) and torch.equal(a.images, b.images)
    assert not torch.equal(a.latents[0, 1:], a.latents[1, 1:])
    assert not torch.equal(aio(wan_engine.generate(request(seed=8))).latents, a.latents)
    wan_engine.batched_groups = False  # the group as 3 requests of one video each
    try:
        per_sample = aio(wan_engine.generate(request()))
    finally:
        wan_engine.batched_groups = True
    assert (per_sample.latents - a.latents).abs().max() < 1e-5


@pytest.mark.parametrize("cfg", [1.0, 3.0])
@pytest.mark.parametrize("sde_type", ["sde", "cps"])
def test_the_trainer_scores_what_the_engine_sampled(wan_engine, aio, trainer_transformer, cfg, sde_type):
    traj = aio(wan_engine.generate(request(guidance_scale=cfg, sde_type=sde_type)))
    assert torch.equal(scored(trainer_transformer, traj), traj.log_probs)  # fp32, one device: bit for bit
    assert (traj.negative_prompt_embeds is None) == (cfg == 1.0)


def test_a_lora_in_memory_changes_the_videos_and_keeps_parity(wan_engine, aio, tiny_wan_dir, lora_v2):
    from app.models.lora import attach_lora

    base = aio(wan_engine.generate(request()))
    try:
        assert aio(wan_engine.load_lora(lora_v2)) == 2
        tuned_traj = aio(wan_engine.generate(request()))
    finally:
        aio(wan_engine.load_lora(None))
    assert tuned_traj.lora_version == 2 and (tuned_traj.latents - base.latents).abs().max() > 1e-2
    tuned = FAMILY.load_denoiser(tiny_wan_dir, dtype=torch.float32, device=torch.device("cpu")).eval()
    attach_lora(tuned, lora_v2)
    assert torch.equal(scored(tuned, tuned_traj), tuned_traj.log_probs)
    assert torch.equal(aio(wan_engine.generate(request())).latents, base.latents)  # reset: the base model again


def test_the_stock_pipeline_draws_what_the_ode_draws(wan_engine, aio):
    """noise_level 0 is the Euler ODE: diffusers' own WanPipeline (its scheduler step, its CFG) makes the videos our
    sampler makes with the same noise."""
    for cfg in (1.0, 3.0):
        req = request(noise_level=0.0, guidance_scale=cfg)
        ode = aio(wan_engine.generate(req))
        assert (aio(wan_engine.generate_plain(req)).int() - ode.images.int()).abs().max() <= 1


def test_a_request_without_frames_or_with_a_count_the_vae_cannot_take_is_refused(wan_engine, aio):
    for frames, message in ((None, "is required"), (8, "4k \\+ 1")):
        with pytest.raises(RequestError, match=message) as err:
            aio(wan_engine.generate(request(num_frames=frames)))
        assert err.value.field == "num_frames"
    assert aio(wan_engine.generate(request(n=1, num_frames=1))).images.shape == (1, 1, 64, 64, 3)  # one frame: a still
