"""SD3 rollouts: the real vllm-omni engine (our FlowGRPO SD3 pipeline on vllm-omni's, CPU platform) and the
diffusers engine on the tiny SD3. Trajectories as for Qwen-Image; seeds reproduce a group whatever the batching;
the trainer's log-probs equal the rollout's (exactly for the diffusers engine, which runs diffusers' transformer as
the trainer does; within 1e-5 for vllm-omni, whose transformer fuses the q/k/v projections) with and without CFG and
a LoRA; the two engines agree; a LoRA arrives in memory and changes the images."""

import pytest
import torch
from merging import assert_merged_is_the_adapter, sample_both_ways

from app.models.lora import random_lora
from app.models.sd3 import FAMILY
from app.models.sd3 import model as sd3
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
def sd3_vllm_engine(tiny_sd3_dir, vllm_engines):
    """The real vllm-omni engine serving the tiny SD3 through our FlowGRPO SD3 pipeline (one vllm-omni engine lives in
    a process at a time: `vllm_engines` closes another model's first)."""
    return vllm_engines.get(tiny_sd3_dir, family="sd3")


@pytest.fixture(scope="module")
def trainer_transformer(tiny_sd3_dir):
    return FAMILY.load_denoiser(tiny_sd3_dir, dtype=torch.float32, device=DEVICE).eval()


@pytest.fixture(scope="module")
def lora_v2(tiny_sd3_dir):
    transformer = FAMILY.load_denoiser(tiny_sd3_dir, dtype=torch.float32, device=torch.device("cpu"))
    targets = [*FAMILY.lora_targets, "proj_out"]
    return random_lora(transformer, version=2, rank=4, target_modules=targets, seed=0, scale=0.5)


@pytest.fixture
def base_model_after(sd3_vllm_engine, sd3_engine, aio):
    """Tests that load adapters leave the shared engines serving the base model."""
    yield
    aio(sd3_vllm_engine.load_lora(None))
    aio(sd3_engine.load_lora(None))


def scored(transformer, traj) -> torch.Tensor:
    with torch.no_grad():
        steps = FAMILY.score_trajectory(transformer, traj, range(traj.num_inference_steps), range(traj.group_size))
    return torch.stack([s.log_prob for s in steps], dim=1).cpu()  # [n, T]


def test_a_trajectory_records_every_step_and_the_conditioning(sd3_vllm_engine, aio):
    traj = aio(sd3_vllm_engine.generate(request(group_id=5, guidance_scale=4.5)))
    n, t = 3, 4
    assert traj.family == "sd3" and traj.group_id == 5 and traj.producer["engine"] == "vllm_omni"
    assert traj.images.shape == (n, 64, 64, 3) and traj.latents.shape == (n, t + 1, 16, 8, 8)
    assert traj.sigmas[0] == 1 and traj.sigmas[-1] == 0 and torch.allclose(traj.timesteps, traj.sigmas[:-1] * 1000)
    # SD3.5's shift 3, f(s) = 3s / (1 + 2s), of s evenly spaced between f(1) = 1 and f(1/1000), its trained range
    shifted_min = 3e-3 / (1 + 2e-3)
    s = torch.linspace(1, shifted_min, t)
    assert torch.allclose(traj.sigmas[:-1], 3 * s / (1 + 2 * s), atol=1e-6)
    text = 77 + sd3.T5_MAX_LENGTH
    assert traj.prompt_embeds.shape == (text, 32) and int(traj.prompt_mask.sum()) == text
    assert traj.negative_prompt_embeds.shape == (text, 32) and not torch.equal(traj.negative_prompt_embeds,
                                                                              traj.prompt_embeds)
    assert traj.conditioning[sd3.POOLED].shape == (32,) and traj.conditioning[sd3.NEGATIVE_POOLED].shape == (32,)


def test_same_seed_reproduces_the_group_in_either_batching(sd3_vllm_engine, aio):
    a, b = aio(sd3_vllm_engine.generate(request())), aio(sd3_vllm_engine.generate(request()))
    assert torch.equal(a.latents, b.latents) and torch.equal(a.images, b.images)
    assert not torch.equal(a.latents[0, 1:], a.latents[1, 1:])
    assert not torch.equal(aio(sd3_vllm_engine.generate(request(seed=8))).latents, a.latents)
    sd3_vllm_engine.batched_groups = False  # the group as 3 requests of one image each
    try:
        per_sample = aio(sd3_vllm_engine.generate(request()))
    finally:
        sd3_vllm_engine.batched_groups = True
    assert (per_sample.latents - a.latents).abs().max() < 1e-5


@pytest.mark.parametrize("cfg", [1.0, 4.5])
@pytest.mark.parametrize("sde_type", ["sde", "cps"])
def test_the_trainer_scores_what_either_engine_sampled(sd3_vllm_engine, sd3_engine, aio, trainer_transformer, cfg,
                                                       sde_type):
    req = request(guidance_scale=cfg, sde_type=sde_type)
    exact = aio(sd3_engine.generate(req))
    assert torch.equal(scored(trainer_transformer, exact), exact.log_probs)  # fp32, one device: bit for bit
    served = aio(sd3_vllm_engine.generate(req))
    assert (scored(trainer_transformer, served) - served.log_probs).abs().max() <= PARITY_TOL
    # the engines agree with each other; images to the last uint8 step
    assert (served.latents - exact.latents).abs().max() <= 1e-5
    assert (served.images.int() - exact.images.int()).abs().max() <= 1
    assert torch.equal(served.prompt_embeds, exact.prompt_embeds)
    # a deliberately wrong trainer (velocity 1% off) is caught far above the tolerance
    perturbed = scored(_Scaled(trainer_transformer, 1.01), exact)
    assert (perturbed - exact.log_probs).abs().max() > 10 * PARITY_TOL


class _Scaled(torch.nn.Module):
    """The transformer with its velocity scaled: a deliberately wrong trainer."""

    def __init__(self, inner, scale):
        super().__init__()
        self.inner, self.scale = inner, scale

    def forward(self, **kwargs):
        return (self.inner(**kwargs)[0] * self.scale,)


def test_a_lora_in_memory_changes_the_images_and_keeps_parity(sd3_vllm_engine, sd3_engine, aio, tiny_sd3_dir,
                                                               lora_v2, base_model_after):
    from app.models.lora import attach_lora

    base = aio(sd3_engine.generate(request()))
    for engine in (sd3_vllm_engine, sd3_engine):
        assert aio(engine.load_lora(lora_v2)) == 2
    served, exact = aio(sd3_vllm_engine.generate(request())), aio(sd3_engine.generate(request()))
    assert served.lora_version == exact.lora_version == 2
    assert (exact.latents - base.latents).abs().max() > 1e-2 and not torch.equal(exact.images, base.images)
    assert (served.latents - exact.latents).abs().max() <= 1e-5
    tuned = FAMILY.load_denoiser(tiny_sd3_dir, dtype=torch.float32, device=DEVICE).eval()
    attach_lora(tuned, lora_v2)
    assert torch.equal(scored(tuned, exact), exact.log_probs)
    assert (scored(tuned, served) - served.log_probs).abs().max() <= PARITY_TOL


def test_the_stock_pipelines_draw_what_the_ode_draws(sd3_vllm_engine, sd3_engine, aio):
    """noise_level 0 is the Euler ODE: diffusers' own SD3 pipeline (its scheduler step, CFG as one batch of two)
    makes the images our sampler makes with the same noise."""
    req = request(noise_level=0.0, guidance_scale=4.5)
    ode = aio(sd3_engine.generate(req))
    assert (aio(sd3_engine.generate_plain(req)).int() - ode.images.int()).abs().max() <= 1


def test_an_engine_that_merges_samples_what_the_adapter_samples(sd3_engine, aio, tiny_sd3_dir, lora_v2):
    """`rollout.merge_lora` on SD3, the base weights' copy kept on the host."""
    from app.rollout.sd3_engine import SD3Engine

    engine = SD3Engine(tiny_sd3_dir, merge_lora="host")
    try:
        groups = sample_both_ways(sd3_engine, engine, request(), lora_v2, aio)
    finally:
        aio(engine.close())
    assert_merged_is_the_adapter(groups, version=2, moved=1e-2)
