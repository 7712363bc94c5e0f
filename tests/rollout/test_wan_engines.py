"""Wan rollouts on the tiny Wan: the diffusers engine and the real vllm-omni engine (our FlowGRPO Wan pipeline on
vllm-omni's `Wan22Pipeline`, CPU platform). A group is N videos ([n, F, H, W, 3] frames, fp32 video latents
[n, T+1, C, F', h, w]) with every step recorded on Wan's flow schedule (the checkpoint's shift, not vllm-omni's
UniPC); seeds reproduce a group whatever the batching; the trainer's log-probs equal the diffusers engine's bit for
bit and vllm-omni's within 1e-6 (vLLM fuses q/k/v) with and without CFG and a LoRA served in memory; the two engines
draw the same videos (latents within 1e-5, frames within one level of 255); noise_level 0 is diffusers' own
WanPipeline; a request without frames is refused naming the field."""

import pytest
import torch

from app.models.lora import attach_lora, random_lora
from app.models.wan import FAMILY
from app.models.wan import model as wan
from app.types import GenerationRequest, RequestError

VLLM = [pytest.mark.slow, pytest.mark.engine]  # vllm-omni's engine in its own process
PARITY_TOL = 1e-6
ENGINES_TOL = 1e-5
# the trainer runs where the engines run (bit for bit needs the same kernels): the CPU here, CUDA on a GPU machine
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def request(**changes) -> GenerationRequest:
    fields = dict(prompt='a sign that says "OPEN"', n=3, height=64, width=64, num_frames=9, num_inference_steps=4,
                  noise_level=0.7, sde_type="sde", seed=7)
    if changes.get("guidance_scale", 1.0) > 1:
        fields["negative_prompt"] = " "
    return GenerationRequest(**(fields | changes))


@pytest.fixture(scope="module")
def wan_vllm_engine(tiny_wan_dir, vllm_engines):
    """The real vllm-omni engine serving the tiny Wan through our FlowGRPO Wan pipeline."""
    return vllm_engines.get(tiny_wan_dir, family="wan")


@pytest.fixture(scope="module")
def trainer_transformer(tiny_wan_dir):
    return FAMILY.load_denoiser(tiny_wan_dir, dtype=torch.float32, device=DEVICE).eval()


@pytest.fixture(scope="module")
def lora_v2(tiny_wan_dir):
    transformer = FAMILY.load_denoiser(tiny_wan_dir, dtype=torch.float32, device=torch.device("cpu"))
    return random_lora(transformer, version=2, rank=4, target_modules=list(FAMILY.lora_targets), seed=0, scale=0.5)


def scored(transformer, traj) -> torch.Tensor:
    with torch.no_grad():
        steps = FAMILY.score_trajectory(transformer, traj, range(traj.num_inference_steps), range(traj.group_size))
    return torch.stack([s.log_prob for s in steps], dim=1).cpu()  # [n, T]


def test_a_group_is_n_videos_with_every_step_recorded(wan_engine, aio):
    traj = aio(wan_engine.generate(request(group_id=5, guidance_scale=3.0)))
    n, t = 3, 4
    assert traj.family == "wan" and traj.group_id == 5 and traj.num_frames == 9 and traj.is_video
    assert traj.images.shape == (n, 9, 64, 64, 3) and traj.images.dtype == torch.uint8
    assert traj.latents.shape == (n, t + 1, 16, 3, 8, 8) and traj.latents.dtype == torch.float32
    assert traj.sigmas[0] == 1 and traj.sigmas[-1] == 0 and torch.allclose(traj.timesteps, traj.sigmas[:-1] * 1000)
    assert traj.prompt_embeds.shape == (512, 32) and traj.negative_prompt_embeds.shape == (512, 32)
    assert not torch.equal(traj.images[0, 0], traj.images[0, -1])  # frames differ: a video, not a still


@pytest.fixture(params=["wan_engine", pytest.param("wan_vllm_engine", marks=VLLM)])
def either_engine(request):
    """Each engine in turn: the diffusers engine, then vllm-omni's."""
    return request.getfixturevalue(request.param)


def test_same_seed_reproduces_the_group_in_either_batching(either_engine, aio):
    engine = either_engine
    a, b = aio(engine.generate(request())), aio(engine.generate(request()))
    assert torch.equal(a.latents, b.latents) and torch.equal(a.images, b.images)
    assert not torch.equal(a.latents[0, 1:], a.latents[1, 1:])
    assert not torch.equal(aio(engine.generate(request(seed=8))).latents, a.latents)
    engine.batched_groups = False  # the group as 3 requests of one video each
    try:
        per_sample = aio(engine.generate(request()))
    finally:
        engine.batched_groups = True
    assert (per_sample.latents - a.latents).abs().max() < 1e-5


@pytest.mark.parametrize("cfg", [1.0, 3.0])
@pytest.mark.parametrize("sde_type", ["sde", "cps"])
def test_the_trainer_scores_what_the_engine_sampled(wan_engine, aio, trainer_transformer, cfg, sde_type):
    traj = aio(wan_engine.generate(request(guidance_scale=cfg, sde_type=sde_type)))
    assert torch.equal(scored(trainer_transformer, traj), traj.log_probs)  # fp32, one device: bit for bit
    assert (traj.negative_prompt_embeds is None) == (cfg == 1.0)


def test_a_lora_in_memory_changes_the_videos_and_keeps_parity(wan_engine, aio, tiny_wan_dir, lora_v2):
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


@pytest.mark.slow
@pytest.mark.engine
def test_a_group_on_vllm_omni_is_n_videos_on_wans_flow_schedule(wan_vllm_engine, aio, tiny_wan_dir):
    traj = aio(wan_vllm_engine.generate(request(group_id=5, guidance_scale=3.0)))
    n, t = 3, 4
    assert traj.family == "wan" and traj.group_id == 5 and traj.producer["engine"] == "vllm_omni" and traj.is_video
    assert traj.images.shape == (n, 9, 64, 64, 3) and traj.images.dtype == torch.uint8
    assert traj.latents.shape == (n, t + 1, 16, 3, 8, 8) and traj.log_probs.shape == (n, t)
    timesteps, sigmas = wan.schedule(wan.pipeline_settings(tiny_wan_dir)["flow_shift"], t)
    assert torch.equal(traj.sigmas, sigmas) and torch.equal(traj.timesteps, timesteps)  # not vllm-omni's UniPC
    assert traj.prompt_embeds.shape == (512, 32) and traj.negative_prompt_embeds.shape == (512, 32)
    assert int(traj.prompt_mask.sum()) == 512 and not torch.equal(traj.images[0, 0], traj.images[0, -1])
    assert aio(wan_vllm_engine.generate(request())).negative_prompt_embeds is None  # s = 1: one forward a step


@pytest.mark.slow
@pytest.mark.engine
@pytest.mark.parametrize("cfg", [1.0, 3.0])
@pytest.mark.parametrize("sde_type", ["sde", "cps"])
def test_the_trainer_scores_what_vllm_omni_sampled(wan_vllm_engine, wan_engine, aio, trainer_transformer, cfg,
                                                   sde_type):
    req = request(guidance_scale=cfg, sde_type=sde_type)
    served, exact = aio(wan_vllm_engine.generate(req)), aio(wan_engine.generate(req))
    assert (scored(trainer_transformer, served) - served.log_probs).abs().max() <= PARITY_TOL
    assert (served.latents - exact.latents).abs().max() <= ENGINES_TOL
    assert (served.images.int() - exact.images.int()).abs().max() <= 1
    assert torch.equal(served.prompt_embeds, exact.prompt_embeds)
    assert (served.negative_prompt_embeds is None) == (cfg == 1.0)


@pytest.mark.slow
@pytest.mark.engine
def test_a_lora_in_memory_on_vllm_omni_changes_the_videos_and_keeps_parity(wan_vllm_engine, aio, tiny_wan_dir, lora_v2):
    base = aio(wan_vllm_engine.generate(request()))
    try:
        assert aio(wan_vllm_engine.load_lora(lora_v2)) == 2  # every target, the MLP's included (vllm-omni's names)
        served = aio(wan_vllm_engine.generate(request()))
    finally:
        aio(wan_vllm_engine.load_lora(None))
    assert served.lora_version == 2 and (served.latents - base.latents).abs().max() > 1e-2
    tuned = FAMILY.load_denoiser(tiny_wan_dir, dtype=torch.float32, device=DEVICE).eval()
    attach_lora(tuned, lora_v2)
    assert (scored(tuned, served) - served.log_probs).abs().max() <= PARITY_TOL
    assert torch.equal(aio(wan_vllm_engine.generate(request())).latents, base.latents)  # the base model again


@pytest.mark.slow
@pytest.mark.engine
def test_vllm_omni_s_stock_pipeline_samples_videos_and_frames_are_checked(wan_vllm_engine, aio):
    """Plain requests run vllm-omni's own Wan sampling (its UniPC); a request without frames, or with a count Wan's
    VAE cannot take, is refused naming the field before it reaches vllm-omni."""
    plain = aio(wan_vllm_engine.generate_plain(request(n=2)))
    assert plain.shape == (2, 9, 64, 64, 3) and plain.dtype == torch.uint8
    for frames, message in ((None, "is required"), (8, "4k \\+ 1")):
        with pytest.raises(RequestError, match=message) as err:
            aio(wan_vllm_engine.generate(request(num_frames=frames)))
        assert err.value.field == "num_frames"


@pytest.mark.slow
@pytest.mark.engine
def test_a_merging_vllm_omni_engine_samples_what_the_adapter_samples(wan_vllm_engine, aio, lora_v2):
    """`rollout.merge_lora` on Wan: the adapter folded into vllm-omni's weights through the pipeline's loader (the fused
    q/k/v, the MLP under its own names) samples what vLLM's LoRA layers sample, to fp32 rounding; the base model comes
    back bit for bit. One engine in a process: the same engine serves the adapter both ways."""
    from merging import assert_merged_is_the_adapter

    groups = {"base": aio(wan_vllm_engine.generate(request()))}
    try:
        aio(wan_vllm_engine.load_lora(lora_v2))
        groups["unmerged"] = aio(wan_vllm_engine.generate(request()))
        aio(wan_vllm_engine.load_lora(None))
        wan_vllm_engine.merge_lora = True
        assert aio(wan_vllm_engine.load_lora(lora_v2)) == 2 and aio(wan_vllm_engine.health())["lora_merged"]
        groups["merged"] = aio(wan_vllm_engine.generate(request()))
        aio(wan_vllm_engine.load_lora(None))
        groups["again"] = aio(wan_vllm_engine.generate(request()))
    finally:
        aio(wan_vllm_engine.load_lora(None))
        wan_vllm_engine.merge_lora = False
    assert_merged_is_the_adapter(groups, version=2, moved=1e-2)
