"""Z-Image rollouts: the real vllm-omni engine (our FlowGRPO Z-Image pipeline on vllm-omni's, CPU platform) and the
diffusers engine on the tiny Z-Image. Trajectories as for the other families (fp32 latents, the captions at their
own lengths); seeds reproduce a group whatever the batching; the trainer's log-probs equal the rollout's (bit for
bit for the diffusers engine; within 1e-5 for vllm-omni, whose transformer fuses q/k/v and the MLP's w1/w3) with and
without CFG and a LoRA; the two engines agree; a LoRA arrives in memory."""

import dataclasses

import pytest
import torch
from merging import assert_merged_is_the_adapter, sample_both_ways

from app.models.lora import random_lora
from app.models.z_image import FAMILY
from app.models.z_image import model as z_image
from app.types import GenerationRequest

pytestmark = [pytest.mark.slow, pytest.mark.engine]  # vllm-omni's engine in its own process
PARITY_TOL = 1e-5
# the trainer runs where the engines run (bit for bit needs the same kernels): the CPU here, CUDA on a GPU machine
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def request(**changes) -> GenerationRequest:
    fields = dict(prompt='a sign that says "OPEN"', n=3, height=64, width=64, num_inference_steps=4,
                  noise_level=0.7, sde_type="sde", seed=7)
    if changes.get("guidance_scale", 1.0) > 1:
        fields["negative_prompt"] = " "
    return GenerationRequest(**(fields | changes))


@pytest.fixture(scope="module")
def z_vllm_engine(tiny_z_image_dir, vllm_engines):
    """The real vllm-omni engine serving the tiny Z-Image through our FlowGRPO Z-Image pipeline."""
    return vllm_engines.get(tiny_z_image_dir, family="z_image")


@pytest.fixture(scope="module")
def trainer_transformer(tiny_z_image_dir):
    return FAMILY.load_denoiser(tiny_z_image_dir, dtype=torch.float32, device=DEVICE).eval()


@pytest.fixture(scope="module")
def lora_v2(tiny_z_image_dir):
    transformer = FAMILY.load_denoiser(tiny_z_image_dir, dtype=torch.float32, device=torch.device("cpu"))
    return random_lora(transformer, version=2, rank=4, target_modules=list(FAMILY.lora_targets), seed=0, scale=0.5)


@pytest.fixture
def base_model_after(z_vllm_engine, z_image_engine, aio):
    """Tests that load adapters leave the shared engines serving the base model."""
    yield
    aio(z_vllm_engine.load_lora(None))
    aio(z_image_engine.load_lora(None))


def scored(transformer, traj) -> torch.Tensor:
    with torch.no_grad():
        steps = FAMILY.score_trajectory(transformer, traj, range(traj.num_inference_steps), range(traj.group_size))
    return torch.stack([s.log_prob for s in steps], dim=1).cpu()  # [n, T]


def test_a_trajectory_records_every_step_and_the_captions(z_vllm_engine, aio):
    traj = aio(z_vllm_engine.generate(request(group_id=5, guidance_scale=3.0)))
    n, t = 3, 4
    assert traj.family == "z_image" and traj.group_id == 5 and traj.producer["engine"] == "vllm_omni"
    assert traj.images.shape == (n, 64, 64, 3) and traj.latents.shape == (n, t + 1, 16, 8, 8)
    assert traj.sigmas[0] == 1 and traj.sigmas[-1] == 0 and torch.allclose(traj.timesteps, traj.sigmas[:-1] * 1000)
    sigmas = torch.tensor(z_image.default_sigmas(t))
    assert torch.allclose(traj.sigmas[:-1], 3 * sigmas / (1 + 2 * sigmas))  # diffusers' schedule, shifted by 3
    assert traj.prompt_embeds.shape[1] == 32 and int(traj.prompt_mask.sum()) == traj.prompt_embeds.shape[0]
    assert traj.negative_prompt_embeds.shape[0] < traj.prompt_embeds.shape[0]  # " " is fewer tokens: no padding
    assert aio(z_vllm_engine.generate(request())).negative_prompt_embeds is None  # s = 1: one forward a step


def test_same_seed_reproduces_the_group_in_either_batching(z_vllm_engine, aio):
    a, b = aio(z_vllm_engine.generate(request())), aio(z_vllm_engine.generate(request()))
    assert torch.equal(a.latents, b.latents) and torch.equal(a.images, b.images)
    assert not torch.equal(a.latents[0, 1:], a.latents[1, 1:])
    assert not torch.equal(aio(z_vllm_engine.generate(request(seed=8))).latents, a.latents)
    z_vllm_engine.batched_groups = False  # the group as 3 requests of one image each
    try:
        per_sample = aio(z_vllm_engine.generate(request()))
    finally:
        z_vllm_engine.batched_groups = True
    assert (per_sample.latents - a.latents).abs().max() < 1e-5


@pytest.mark.parametrize("cfg", [1.0, 3.0])
@pytest.mark.parametrize("sde_type", ["sde", "cps"])
def test_the_trainer_scores_what_either_engine_sampled(z_vllm_engine, z_image_engine, aio, trainer_transformer, cfg,
                                                       sde_type):
    req = request(guidance_scale=cfg, sde_type=sde_type)
    exact = aio(z_image_engine.generate(req))
    assert torch.equal(scored(trainer_transformer, exact), exact.log_probs)  # fp32, one device: bit for bit
    served = aio(z_vllm_engine.generate(req))
    assert (scored(trainer_transformer, served) - served.log_probs).abs().max() <= PARITY_TOL
    assert (served.latents - exact.latents).abs().max() <= 1e-5
    assert (served.images.int() - exact.images.int()).abs().max() <= 1
    assert torch.equal(served.prompt_embeds, exact.prompt_embeds)
    assert (served.negative_prompt_embeds is None) == (cfg == 1.0)


def test_a_lora_in_memory_changes_the_images_and_keeps_parity(z_vllm_engine, z_image_engine, aio, tiny_z_image_dir,
                                                               lora_v2, base_model_after):
    from app.models.lora import attach_lora

    base = aio(z_image_engine.generate(request()))
    for engine in (z_vllm_engine, z_image_engine):
        assert aio(engine.load_lora(lora_v2)) == 2
    served, exact = aio(z_vllm_engine.generate(request())), aio(z_image_engine.generate(request()))
    assert served.lora_version == exact.lora_version == 2
    assert (exact.latents - base.latents).abs().max() > 1e-2 and not torch.equal(exact.images, base.images)
    assert (served.latents - exact.latents).abs().max() <= 1e-5
    tuned = FAMILY.load_denoiser(tiny_z_image_dir, dtype=torch.float32, device=DEVICE).eval()
    attach_lora(tuned, lora_v2)
    assert torch.equal(scored(tuned, exact), exact.log_probs)
    assert (scored(tuned, served) - served.log_probs).abs().max() <= PARITY_TOL


def test_the_stock_pipeline_draws_what_the_ode_draws(z_image_engine, aio):
    """noise_level 0 is the Euler ODE: diffusers' own ZImagePipeline (its scheduler step, its CFG at its own scale,
    one below ours) makes the images our sampler makes with the same noise."""
    for cfg in (1.0, 3.0):
        req = request(noise_level=0.0, guidance_scale=cfg)
        ode = aio(z_image_engine.generate(req))
        assert (aio(z_image_engine.generate_plain(req)).int() - ode.images.int()).abs().max() <= 1


def test_an_engine_that_merges_samples_what_the_adapter_samples(z_image_engine, aio, tiny_z_image_dir, lora_v2):
    """`rollout.merge_lora` on Z-Image, the base weights' copy kept on the host."""
    from app.rollout.z_image_engine import ZImageEngine

    engine = ZImageEngine(tiny_z_image_dir, merge_lora="host")
    try:
        groups = sample_both_ways(z_image_engine, engine, request(), lora_v2, aio)
    finally:
        aio(engine.close())
    assert_merged_is_the_adapter(groups, version=2, moved=1e-2)


def test_the_base_model_through_a_zero_adapter_is_the_base_model_and_stays_staged(vllm_engines, aio, tiny_z_image_dir,
                                                                                    lora_v2):
    """vLLM puts its LoRA layers into the transformer at the first adapter it serves, so a compiled engine (CUDA)
    that served step 1's base model without one compiled every block again at step 2. It serves the base model
    through a zero adapter of the run's shape instead (`zero_adapter_for_base`: on when compiled; asked for here,
    where vllm-omni's CPU platform runs eager): the same group bit for bit, through the LoRA layers, and the zero
    adapter stays staged while published versions come and go."""
    from app.rollout.vllm_omni.lora import BASE_LORA_ID, zero_lora

    zero = zero_lora(tiny_z_image_dir, rank=4, alpha=4, target_modules=FAMILY.lora_targets, dtype=torch.float32)
    assert {k: v.shape for k, v in zero.tensors.items()} == {k: v.shape for k, v in lora_v2.tensors.items()}
    assert all(not t.any() for k, t in zero.tensors.items() if ".lora_B." in k)

    base = aio(vllm_engines.get(tiny_z_image_dir, family="z_image").generate(request()))
    engine = vllm_engines.get(tiny_z_image_dir, family="z_image", zero_adapter_for_base=True, lora_rank=4,
                              lora_alpha=4, lora_targets=tuple(FAMILY.lora_targets))
    served = aio(engine.generate(request()))
    assert aio(engine._rpc("lora_state"))["active"] == BASE_LORA_ID
    assert served.lora_version == 0
    assert torch.equal(served.latents, base.latents) and torch.equal(served.log_probs, base.log_probs)
    assert torch.equal(served.images, base.images)

    for version in (2, 3, 4):  # more than the worker keeps staged
        aio(engine.load_lora(dataclasses.replace(lora_v2, version=version)))
        aio(engine.generate(request(n=1)))
    state = aio(engine._rpc("lora_state"))
    assert state["active"] == 4 and state["staged"][0] == BASE_LORA_ID and state["staged"][1:] == [3, 4]
    aio(engine.load_lora(None))  # reset: the base model through the zero adapter again
    again = aio(engine.generate(request()))
    assert aio(engine._rpc("lora_state"))["active"] == BASE_LORA_ID
    assert torch.equal(again.latents, base.latents)
