"""vllm-omni's BAGEL pipeline (the real engine, single stage, bf16 on this CPU) as a FlowGRPO rollout engine: groups
of n with per-sample noise, text to image and edits, the conditioning the trainer rebuilds contexts from, the
trainer's recompute of its log-probs within a measured bound, and our LoRA of the generation expert served from
memory (it changes the images; resetting to the base model restores them exactly)."""

import dataclasses

import numpy as np
import pytest
import torch

from app.models.bagel import GENERATION_TARGETS
from app.models.bagel.context import text_conditioning
from app.models.bagel.model import BagelMoT
from app.models.lora import random_lora
from app.train.policy import Policy
from app.types import GenerationRequest

# the real engine, built for each kind of request (about 40 s on 2 AVX2 cores)
pytestmark = [pytest.mark.slow, pytest.mark.engine]

TARGETS = GENERATION_TARGETS
EDIT = torch.from_numpy((np.random.default_rng(1).random((64, 64, 3)) * 255).astype(np.uint8))
CFG = dict(guidance_scale=4.0, negative_prompt="", image_guidance_scale=1.5, cfg_interval=(0.4, 1.0))
# max |log-prob| gap between vllm-omni's bf16 rollout and the fp32 trainer, per step (mean log-density per latent
# element). Measured on this CPU: see test_the_trainer_recomputes_its_log_probs_within_the_bound
RECOMPUTE_BOUND = 5e-3  # largest measured: 1.8e-3 (an edit with CFG and a LoRA)


@pytest.fixture(scope="module")
def engine(tiny_bagel_dir, vllm_engines):
    return vllm_engines.get(tiny_bagel_dir, family="bagel")  # closes another model's vllm-omni engine first


@pytest.fixture(scope="module")
def adapter(tiny_bagel_dir):
    return random_lora(BagelMoT.from_checkpoint(tiny_bagel_dir), version=1, rank=4, target_modules=TARGETS, seed=3,
                       scale=0.5)


@pytest.fixture(scope="module")
def text_group(engine, aio):
    return aio(engine.generate(request(edit=False, cfg=True, sde_window=(1, 3))))  # step 0: the ODE step


@pytest.fixture(scope="module")
def edit_group(engine, aio):
    return aio(engine.generate(request(edit=True, cfg=True)))


def request(*, edit: bool, cfg: bool, n: int = 2, **fields) -> GenerationRequest:
    extra = ({"image": EDIT} if edit else {}) | (CFG if cfg else {})
    return GenerationRequest('a sign that says "RL"', n=n, height=64, width=64, num_inference_steps=3,
                             noise_level=0.8, sde_type="sde", seed=9, **extra, **fields)


def trainer_log_probs(model_dir, traj, adapter=None) -> torch.Tensor:
    policy = Policy.from_pretrained(model_dir, lora_rank=4, lora_alpha=4, target_modules=TARGETS, family="bagel",
                                    adapter_tensors=adapter.tensors if adapter else None, shard=False)
    with torch.no_grad():
        outs = policy.score(traj, range(traj.num_inference_steps), range(traj.group_size))
    return torch.stack([o.log_prob for o in outs], dim=1)


def test_a_group_is_n_samples_each_from_its_own_noise(engine, aio, tiny_bagel_dir, text_group):
    group = text_group
    assert group.family == "bagel" and group.latents.shape == (2, 4, 16, 64) and group.log_probs.shape == (2, 3)
    assert group.images.shape == (2, 64, 64, 3) and group.images.dtype == torch.uint8
    assert torch.isfinite(group.log_probs).all() and not torch.equal(group.latents[0], group.latents[1])
    # an SDE window: only its steps carry a log-prob (the trainer scores the ODE step 0 as 0 too, below)
    assert torch.equal(group.log_probs[:, 0], torch.zeros(2)) and (group.log_probs[:, 1:] != 0).all()
    # the second sample alone (its offset in the group) is the same sample: noise never depends on the batch
    alone = aio(engine.generate(request(edit=False, cfg=True, n=1, sample_offset=1, sde_window=(1, 3))))
    assert torch.equal(alone.latents[0], group.latents[1]) and torch.equal(alone.log_probs[0], group.log_probs[1])
    # the recorded sigmas are BAGEL's shifted schedule with T + 1 points; token ids as our tokenizer makes them
    assert group.sigmas.shape == (4,) and group.sigmas[0] == 1 and group.sigmas[-1] == 0
    from transformers import Qwen2Tokenizer

    ours = text_conditioning(Qwen2Tokenizer.from_pretrained(tiny_bagel_dir), group.prompt, None)
    assert torch.equal(group.conditioning["prompt_ids"], ours["prompt_ids"])
    assert torch.equal(group.conditioning["image_tokens"], ours["image_tokens"])


def test_an_edit_records_its_input_image_as_the_trainer_needs_it(edit_group, bagel_engine):
    traj = edit_group
    ours = bagel_engine.conditioning(request(edit=True, cfg=True))  # our engine's fp32 encoding of the same image
    assert torch.equal(traj.conditioning["edit_grid"], ours["edit_grid"])
    assert traj.conditioning["edit_latents"].shape == ours["edit_latents"].shape
    assert torch.equal(traj.conditioning["edit_vit"], ours["edit_vit"])  # the same SigLIP preprocessing
    # the same autoencoder in bf16 (vllm-omni) and fp32 (ours): close, not equal
    gap = (traj.conditioning["edit_latents"] - ours["edit_latents"]).abs().max()
    assert 0 < gap < 0.1 * ours["edit_latents"].abs().max(), gap


@pytest.mark.parametrize("case", ["t2i", "edit", "edit+lora"])
def test_the_trainer_recomputes_its_log_probs_within_the_bound(engine, aio, tiny_bagel_dir, adapter, text_group,
                                                               edit_group, case):
    if case == "edit+lora":  # the adapter shapes the edit's context too (its image runs through the gen expert)
        version = aio(engine.load_lora(dataclasses.replace(adapter, version=engine.lora_version + 1)))
        try:
            traj = aio(engine.generate(request(edit=True, cfg=True)))
        finally:
            aio(engine.load_lora(None))
        assert traj.lora_version == version >= 1
    else:
        traj = text_group if case == "t2i" else edit_group
    gap = (trainer_log_probs(tiny_bagel_dir, traj, adapter if traj.lora_version else None) - traj.log_probs).abs()
    print(f"vllm-omni bf16 vs trainer fp32, {case}, CFG: max |Δ log-prob| {float(gap.max()):.2e} "
          f"(per step {[round(float(g), 5) for g in gap.max(0).values]})")
    assert 0 < gap.max() <= RECOMPUTE_BOUND  # bf16 against fp32: never exact, always close


def test_a_published_lora_changes_the_images_and_resetting_restores_them(engine, aio, adapter):
    # (text to image: an edit's context under the adapter is checked against the trainer above)
    base = aio(engine.generate(request(edit=False, cfg=False, n=1)))
    version = aio(engine.load_lora(dataclasses.replace(adapter, version=engine.lora_version + 1)))
    adapted = aio(engine.generate(request(edit=False, cfg=False, n=1)))
    assert adapted.lora_version == version >= 1
    assert (adapted.latents[:, -1] - base.latents[:, -1]).abs().max() > 1e-2
    aio(engine.load_lora(None))
    again = aio(engine.generate(request(edit=False, cfg=False, n=1)))
    assert again.lora_version == 0
    assert torch.equal(again.latents, base.latents) and torch.equal(again.images, base.images)


def test_an_adapter_on_modules_it_cannot_serve_is_refused_before_it_is_staged(engine, aio, adapter):
    bad = dataclasses.replace(adapter, version=engine.lora_version + 1, target_modules=["mlp.down_proj"],
                              tensors={k.replace("mlp_moe_gen.down_proj", "mlp.down_proj"): v
                                       for k, v in adapter.tensors.items() if "mlp_moe_gen.down_proj" in k})
    with pytest.raises(ValueError, match="generation expert"):
        aio(engine.load_lora(bad))
    assert engine.lora_version == 0


def test_a_bagel_model_section_makes_a_bf16_bagel_engine(tiny_bagel_dir):
    from app.config import ModelConfig, RolloutConfig
    from deployments.rollout import make_engine

    engine = make_engine(ModelConfig(family="bagel", path=str(tiny_bagel_dir)), RolloutConfig(engine="vllm_omni"))
    assert (engine.kind, engine.family, engine.dtype) == ("vllm_omni", "bagel", "bfloat16")  # not started
    with pytest.raises(ValueError, match="model.family=.sd9. is not one of"):
        type(engine)(tiny_bagel_dir, family="sd9")
