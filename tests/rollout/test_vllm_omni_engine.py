"""The real vllm-omni engine (CPU platform, tiny Qwen-Image): trajectories, seeding, batching, LoRA in memory, and
exact parity with the trainer-side recompute and with the diffusers reference engine."""

import dataclasses
import time

import pytest
import torch
from diffusers import QwenImageTransformer2DModel
from merging import assert_merged_is_the_adapter

from app.models.lora import attach_lora, random_lora
from app.models.qwen_image import model as qwen_image
from app.rollout.vllm_omni.engine import WorkerError, _first_result
from app.types import GenerationRequest, LoraAdapter

TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
           "img_mlp.net.2"]
PARITY_TOL = 1e-5
pytestmark = pytest.mark.engine  # CPU platform here, CUDA on a GPU machine


def request(**changes) -> GenerationRequest:
    fields = dict(prompt="a red cube", n=3, height=64, width=64, num_inference_steps=4, noise_level=0.7, sde_type="sde",
                  seed=7)
    return GenerationRequest(**(fields | changes))


@pytest.fixture(scope="module")
def trainer_transformer(tiny_model_dir):
    return QwenImageTransformer2DModel.from_pretrained(tiny_model_dir, subfolder="transformer").eval()


@pytest.fixture(scope="module")
def lora_v3(tiny_model_dir):
    transformer = QwenImageTransformer2DModel.from_pretrained(tiny_model_dir, subfolder="transformer")
    return random_lora(transformer, version=3, rank=4, target_modules=TARGETS, seed=0, scale=0.5)


@pytest.fixture
def base_model_after(vllm_engine, aio):
    """Tests that load adapters leave the shared engine serving the base model."""
    yield
    aio(vllm_engine.load_lora(None))


class ScaledVelocity(torch.nn.Module):
    """The transformer with its output scaled: a deliberately wrong trainer."""

    def __init__(self, inner, scale):
        super().__init__()
        self.inner, self.scale = inner, scale

    def forward(self, **kwargs):
        return (self.inner(**kwargs)[0] * self.scale,)


def recompute(transformer, traj):
    with torch.no_grad():
        steps = qwen_image.score_trajectory(transformer, traj, range(traj.num_inference_steps))
    return torch.stack([s.log_prob for s in steps], dim=1)  # [n, T]


def test_trajectory_records_every_step(vllm_engine, aio):
    traj = aio(vllm_engine.generate(request(group_id=3)))
    n, t = 3, 4
    assert traj.images.shape == (n, 64, 64, 3) and traj.images.dtype == torch.uint8
    assert traj.latents.shape == (n, t + 1, 16, 64) and traj.log_probs.shape == (n, t)
    assert traj.sigmas[0] == 1 and traj.sigmas[-1] == 0 and torch.all(traj.sigmas[1:] < traj.sigmas[:-1])
    assert torch.allclose(traj.timesteps, traj.sigmas[:-1] * 1000)
    assert torch.isfinite(traj.log_probs).all() and traj.prompt_embeds.shape == (8, 32)  # 3 prompt + 5 suffix tokens
    assert traj.lora_version == 0 and traj.seed == 7 and traj.group_id == 3
    assert traj.producer["engine"] == "vllm_omni"


def test_same_seed_reproduces_the_group_and_members_differ(vllm_engine, aio):
    a, b = aio(vllm_engine.generate(request())), aio(vllm_engine.generate(request()))
    assert torch.equal(a.latents, b.latents) and torch.equal(a.images, b.images)
    assert not torch.equal(a.latents[0, 1:], a.latents[1, 1:])
    other = aio(vllm_engine.generate(request(seed=8)))
    assert not torch.equal(other.latents, a.latents)
    drawn = aio(vllm_engine.generate(request(seed=None)))
    assert drawn.seed is not None and torch.equal(aio(vllm_engine.generate(request(seed=drawn.seed))).latents,
                                                  drawn.latents)


def test_per_sample_mode_reproduces_the_batched_group(vllm_engine, aio):
    """n requests of one image draw the same noise as one request of n; the only difference is the float
    rounding of a batched vs an unbatched transformer forward (≈5e-7 here)."""
    batched = aio(vllm_engine.generate(request()))
    vllm_engine.batched_groups = False
    try:
        per_sample = aio(vllm_engine.generate(request()))
    finally:
        vllm_engine.batched_groups = True
    assert (per_sample.latents - batched.latents).abs().max() < 1e-5
    assert (per_sample.log_probs - batched.log_probs).abs().max() < 1e-5


def test_concurrent_groups_match_sequential_ones(vllm_engine, aio):
    import asyncio

    requests = [request(seed=s, prompt=p) for s, p in [(1, "a cat"), (2, "a red cube"), (3, 'a sign "OPEN"')]]

    async def both():
        began = time.perf_counter()
        together = await asyncio.gather(*[vllm_engine.generate(r) for r in requests])
        wall = time.perf_counter() - began
        alone = [await vllm_engine.generate(r) for r in requests]
        return together, wall, alone

    together, wall, alone = aio(both())
    for a, b in zip(together, alone, strict=True):
        assert a.prompt == b.prompt and (a.latents - b.latents).abs().max() < 1e-5
    # the engine's seconds are its busy time shared among the groups in flight: they add up to no more than the
    # time the three took together (each group's own wall time, queueing included, would count it about twice)
    charged = [t.producer["seconds"] for t in together]
    assert min(charged) > 0 and sum(charged) <= wall + 1e-3


@pytest.mark.parametrize("sde_type", ["sde", "cps"])
@pytest.mark.parametrize("cfg", [1.0, 3.0])
def test_log_probs_equal_the_trainer_recompute(vllm_engine, aio, trainer_transformer, sde_type, cfg):
    req = request(sde_type=sde_type, guidance_scale=cfg, negative_prompt=" " if cfg > 1 else None)
    traj = aio(vllm_engine.generate(req))
    diff = (recompute(trainer_transformer, traj) - traj.log_probs).abs().max().item()
    assert diff <= PARITY_TOL, diff
    # the check has teeth: a 1% change of the velocity moves the log-probs far beyond the tolerance
    perturbed = (recompute(ScaledVelocity(trainer_transformer, 1.01), traj) - traj.log_probs).abs().max().item()
    assert perturbed > 10 * PARITY_TOL, perturbed


def test_vllm_omni_equals_the_diffusers_engine(vllm_engine, diffusers_engine, aio):
    """Same seed, same sampler, same per-sample noise: identical latents (vllm-omni's DiT and diffusers'
    transformer agree exactly in fp32 on the CPU); images equal to the last uint8 step."""
    for req in (request(), request(guidance_scale=3.0, negative_prompt=" ", sde_type="cps")):
        a, b = aio(vllm_engine.generate(req)), aio(diffusers_engine.generate(req))
        assert (a.latents - b.latents).abs().max() <= 1e-6
        assert (a.log_probs - b.log_probs).abs().max() <= 1e-6
        assert (a.images.int() - b.images.int()).abs().max() <= 1
        assert torch.allclose(a.prompt_embeds, b.prompt_embeds, atol=1e-6)


def test_an_sde_window_puts_noise_only_on_its_steps_in_both_engines(vllm_engine, diffusers_engine, aio,
                                                                     trainer_transformer):
    """Steps 1-2 of 4 stochastic, 0 and 3 the ODE step: both engines take the same steps, only the window's carry
    a log-prob, and the trainer scores every one of them as the rollout did."""
    req = request(sde_window=(1, 3))
    a, b = aio(vllm_engine.generate(req)), aio(diffusers_engine.generate(req))
    assert a.sde_window == (1, 3) and a.stochastic_steps == [1, 2]
    assert (a.latents - b.latents).abs().max() <= 1e-6 and (a.log_probs - b.log_probs).abs().max() <= 1e-6
    assert torch.equal(a.log_probs[:, [0, 3]], torch.zeros(3, 2)) and (a.log_probs[:, 1:3] != 0).all()
    with torch.no_grad():
        scored = qwen_image.score_trajectory(trainer_transformer, a, range(4))
    assert (torch.stack([s.log_prob for s in scored], dim=1) - a.log_probs).abs().max() <= PARITY_TOL
    for i in (0, 3):  # outside the window the next latent is the ODE step's mean itself: no noise was added
        assert (scored[i].prev_sample_mean - a.latents[:, i + 1]).abs().max() <= 1e-5
    assert (scored[1].prev_sample_mean - a.latents[:, 2]).abs().max() > 1e-2  # inside: noise was


def test_lora_in_memory_versions_and_parity(vllm_engine, aio, tiny_model_dir, lora_v3, base_model_after):
    base = aio(vllm_engine.generate(request()))
    assert aio(vllm_engine.load_lora(lora_v3)) == 3
    tuned = aio(vllm_engine.generate(request()))
    assert tuned.lora_version == 3 and vllm_engine.lora_version == 3
    assert not torch.equal(tuned.images, base.images)
    assert (tuned.latents - base.latents).abs().max() > 1e-3
    transformer = QwenImageTransformer2DModel.from_pretrained(tiny_model_dir, subfolder="transformer").eval()
    attach_lora(transformer, lora_v3)  # the trainer's side: the same tensors attached with peft
    diff = (recompute(transformer, tuned) - tuned.log_probs).abs().max().item()
    assert diff <= PARITY_TOL, diff
    assert aio(vllm_engine.load_lora(lora_v3)) == 3  # re-publishing the served version is a no-op
    with pytest.raises(ValueError, match="older than the served version 3"):
        aio(vllm_engine.load_lora(dataclasses.replace(lora_v3, version=2)))


def test_an_adapter_scaled_by_alpha_over_rank_keeps_parity_group_after_group(vllm_engine, aio, tiny_model_dir,
                                                                               base_model_after):
    """The GPU configs train with lora_alpha = 2 x rank, and vllm's LoRA manager folds alpha / r into B in place
    when it loads an adapter: that must reach neither the engine's staged copy (a second load of the version would
    scale it again) nor the caller's tensors, which the worker process shares (they came back scaled by 2: a
    trainer scoring with them was 7e-4 off in log-prob on the tiny model)."""
    transformer = QwenImageTransformer2DModel.from_pretrained(tiny_model_dir, subfolder="transformer").eval()
    adapter = random_lora(transformer, version=5, rank=4, alpha=8, target_modules=TARGETS, seed=1, scale=0.5)
    staged = {k: v.clone() for k, v in adapter.tensors.items()}
    aio(vllm_engine.load_lora(adapter))
    attach_lora(transformer, adapter)
    for _ in range(2):
        traj = aio(vllm_engine.generate(request()))
        assert traj.lora_version == 5
        diff = (recompute(transformer, traj) - traj.log_probs).abs().max().item()
        assert diff <= PARITY_TOL, diff
    assert all(torch.equal(adapter.tensors[k], v) for k, v in staged.items())


def test_a_merging_engine_samples_what_the_adapter_samples(vllm_engine, aio, lora_v3, base_model_after):
    """`rollout.merge_lora` on vllm-omni: the adapter folded into the weights through the pipeline's own loader (into
    the fused q/k/v matrices too) samples what vLLM's LoRA layers sample, to fp32 rounding, and the base model comes
    back bit for bit. One engine in a process: the same engine serves the adapter both ways."""
    groups = {"base": aio(vllm_engine.generate(request()))}
    aio(vllm_engine.load_lora(lora_v3))
    groups["unmerged"] = aio(vllm_engine.generate(request()))
    aio(vllm_engine.load_lora(None))
    vllm_engine.merge_lora = True
    try:
        # what a merging engine asks its worker at its start (`lora_targets`): the targets' base weights read ahead
        read_ahead = aio(vllm_engine._omni.collective_rpc("keep_lora_base", args=(list(TARGETS),)))
        assert _first_result(read_ahead) > 0
        assert aio(vllm_engine.load_lora(lora_v3)) == 3 and aio(vllm_engine.health())["lora_merged"]
        groups["merged"] = aio(vllm_engine.generate(request()))
        assert groups["merged"].producer["adapter_swap_s"] > 0  # the fold, told once by the next group
        assert "adapter_swap_s" not in aio(vllm_engine.generate(request())).producer
        with pytest.raises(NotImplementedError, match="merge_lora=false"):
            aio(vllm_engine.update_weights({}))
        aio(vllm_engine.load_lora(None))
        groups["again"] = aio(vllm_engine.generate(request()))
    finally:
        vllm_engine.merge_lora = False
    assert_merged_is_the_adapter(groups, version=3)


def test_zero_adapter_reproduces_the_base_model_exactly(vllm_engine, aio, lora_v3, base_model_after):
    base = aio(vllm_engine.generate(request()))
    zero = LoraAdapter({k: torch.zeros_like(v) for k, v in lora_v3.tensors.items()}, rank=4, alpha=4,
                       target_modules=TARGETS, version=vllm_engine.lora_version + 10)
    aio(vllm_engine.load_lora(zero))
    out = aio(vllm_engine.generate(request()))
    assert out.lora_version == zero.version
    assert torch.equal(out.latents, base.latents) and torch.equal(out.images, base.images)


def test_full_weight_update_and_restore(vllm_engine, aio, trainer_transformer, lora_v3, base_model_after):
    aio(vllm_engine.load_lora(lora_v3))  # vLLM's LoRA layers now wrap the adapted layers (to_q/k/v, ...)
    aio(vllm_engine.load_lora(None))
    base = aio(vllm_engine.generate(request()))
    state = {k: v.clone() for k, v in trainer_transformer.state_dict().items()}
    g = torch.Generator().manual_seed(0)
    perturbed = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in state.items()}
    assert aio(vllm_engine.update_weights(perturbed)) == len(state)
    changed = aio(vllm_engine.generate(request()))
    aio(vllm_engine.update_weights(state))
    restored = aio(vllm_engine.generate(request()))
    assert not torch.equal(changed.latents, base.latents)
    assert torch.equal(restored.latents, base.latents)
    # only the wrapped layers: they were skipped silently while wrapped
    wrapped = {k: v for k, v in perturbed.items() if ".attn.to_" in k and k.endswith(".weight")}
    aio(vllm_engine.update_weights(wrapped))
    assert not torch.equal(aio(vllm_engine.generate(request())).latents, base.latents)
    aio(vllm_engine.update_weights({k: state[k] for k in wrapped}))
    with pytest.raises(WorkerError, match="fit no parameter"):
        aio(vllm_engine.update_weights({"transformer_blocks.0.attn.no_such_layer.weight": torch.zeros(2, 2)}))
    assert torch.equal(aio(vllm_engine.generate(request())).latents, base.latents)


def test_invalid_requests_never_reach_the_engine(vllm_engine, aio):
    served = aio(vllm_engine.health())["served"]
    with pytest.raises(ValueError, match="n="):
        request(n=0)
    with pytest.raises(TypeError, match="GenerationRequest"):
        aio(vllm_engine.generate({"prompt": "a cat"}))
    assert aio(vllm_engine.health())["served"] == served
    assert aio(vllm_engine.generate(request(n=1))).images.shape[0] == 1  # still serving


def test_versions_restart_at_one_after_a_reset(vllm_engine, aio, lora_v3, base_model_after):
    """A new training run resets the replicas to the base model and publishes version 1 again: the adapter
    staged under id 1 must be the one served, even though higher ids were staged before."""
    top = vllm_engine.lora_version
    for v in (top + 5, top + 6):
        aio(vllm_engine.load_lora(dataclasses.replace(lora_v3, version=v)))
    expected = aio(vllm_engine.generate(request()))
    aio(vllm_engine.load_lora(None))
    assert aio(vllm_engine.load_lora(dataclasses.replace(lora_v3, version=1))) == 1
    again = aio(vllm_engine.generate(request()))
    assert again.lora_version == 1 and torch.equal(again.latents, expected.latents)
