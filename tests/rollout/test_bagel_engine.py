"""Our BAGEL engine: one request per prompt group for text to image and edits, per-sample noise, the edit's input
preprocessing, adapters in memory, and requests it cannot serve refused with a reason."""

import numpy as np
import pytest
import torch
from merging import assert_merged_is_the_adapter, sample_both_ways

from app.models.bagel.context import edit_input_size
from app.models.bagel.model import BagelMoT
from app.models.bagel.tiny import MAX_LATENT_SIZE
from app.models.lora import random_lora
from app.types import GenerationRequest

SAMPLING = dict(height=64, width=64, num_inference_steps=3, noise_level=0.8, sde_type="sde", seed=11)
EDIT = torch.from_numpy((np.random.default_rng(0).random((48, 80, 3)) * 255).astype(np.uint8))
CFG = dict(guidance_scale=4.0, negative_prompt="", image_guidance_scale=1.5, cfg_interval=(0.4, 1.0))


@pytest.mark.parametrize("edit", [False, True])
def test_a_group_is_one_request_with_its_conditioning_recorded(bagel_engine, aio, edit):
    extra = {"image": EDIT} if edit else {}
    request = GenerationRequest('a sign that says "OPEN"', n=3, **SAMPLING, **CFG, **extra)
    traj = aio(bagel_engine.generate(request))
    assert traj.family == "bagel" and traj.images.shape == (3, 64, 64, 3) and traj.images.dtype == torch.uint8
    assert traj.latents.shape == (3, 4, 16, 64) and traj.log_probs.shape == (3, 3)
    assert torch.equal(traj.timesteps, traj.sigmas[:-1]) and traj.sigmas[0] == 1 and traj.sigmas[-1] == 0
    cond = traj.conditioning
    tokenizer = bagel_engine.tokenizer
    assert tokenizer.convert_ids_to_tokens([int(cond["prompt_ids"][0]), int(cond["prompt_ids"][-1])]) == [
        "<|im_start|>", "<|im_end|>"]
    assert "negative_ids" not in cond  # "" is the empty context
    assert ("edit_latents" in cond) == edit
    if edit:  # 80x48 → short side to 128 (the tiny checkpoint's largest), long side capped at 128
        assert tuple(cond["edit_grid"].tolist()) == (8, 8) and cond["edit_latents"].shape == (64, 64)
        assert cond["edit_vit"].shape == (3, 224, 224)  # SigLIP preprocessing of the checkpoint
    assert (traj.image_guidance_scale, traj.cfg_interval) == (1.5, (0.4, 1.0))
    # members of a group differ; the same seed gives the same group
    assert not torch.equal(traj.latents[0], traj.latents[1])
    assert torch.equal(aio(bagel_engine.generate(request)).latents, traj.latents)


def test_each_image_keeps_its_noise_however_the_group_is_split(bagel_engine, aio):
    request = GenerationRequest("a red cube", n=3, **SAMPLING, image=EDIT)
    whole = aio(bagel_engine.generate(request))
    third = aio(bagel_engine.generate(request.replace(n=1, sample_offset=2)))
    torch.testing.assert_close(third.latents[0], whole.latents[2], rtol=1e-5, atol=1e-5)
    assert (third.images[0].int() - whole.images[2].int()).abs().max() <= 1  # batch-size rounding at most


def test_edit_input_size_is_vllm_omnis():
    """At most max_latent_size·16 on the long side, at least min(256, that) on the short side, multiples of 16:
    the same sizes as vllm-omni's own rule, over odd and extreme shapes."""
    from vllm_omni.diffusion.models.bagel.pipeline_bagel import _bagel_effective_image_size

    assert edit_input_size(80, 48, stride=16, max_latent_size=8) == (128, 128)  # the tiny checkpoint's
    for width, height in [(80, 48), (1000, 500), (300, 200), (2000, 1000), (57, 333), (16, 4000), (1024, 1024)]:
        for max_latent_size in (8, 32, 64):
            theirs = _bagel_effective_image_size((width, height), latent_downsample=16,
                                                 max_latent_size=max_latent_size)
            assert edit_input_size(width, height, stride=16, max_latent_size=max_latent_size) == theirs[::-1]


def test_an_adapter_changes_the_images_and_unloading_restores_them(bagel_engine, aio, tiny_bagel_dir):
    request = GenerationRequest('a sign that says "OPEN"', n=2, **SAMPLING, **CFG, image=EDIT)
    base = aio(bagel_engine.generate(request))
    adapter = random_lora(BagelMoT.from_checkpoint(tiny_bagel_dir), version=3, rank=4,
                          target_modules=["q_proj_moe_gen", "mlp_moe_gen.down_proj"], seed=0, scale=0.5)
    try:
        assert aio(bagel_engine.load_lora(adapter)) == 3
        tuned = aio(bagel_engine.generate(request))
    finally:
        aio(bagel_engine.load_lora(None))
    again = aio(bagel_engine.generate(request))
    assert tuned.lora_version == 3 and again.lora_version == 0
    assert (tuned.latents - base.latents).abs().max() > 1e-3
    assert torch.equal(again.latents, base.latents)


def test_requests_it_cannot_serve_say_why(bagel_engine, aio, diffusers_engine):
    largest = MAX_LATENT_SIZE * 16
    with pytest.raises(ValueError, match=f"at most {largest}x{largest}"):
        aio(bagel_engine.generate(GenerationRequest("x", **(SAMPLING | {"height": largest + 16}))))
    with pytest.raises(ValueError, match="^image: model.family=qwen_image generates from text only"):
        aio(diffusers_engine.generate(GenerationRequest("x", **SAMPLING, image=EDIT)))
    assert aio(bagel_engine.health())["errors"] >= 1


def test_an_engine_that_merges_samples_what_the_adapter_samples(bagel_engine, aio, tiny_bagel_dir):
    """`rollout.merge_lora` on BAGEL: the generation expert's adapter folded into its weights."""
    from app.rollout.bagel_engine import BagelEngine

    request = GenerationRequest('a sign that says "OPEN"', n=2, **SAMPLING, **CFG)
    adapter = random_lora(BagelMoT.from_checkpoint(tiny_bagel_dir), version=3, rank=4,
                          target_modules=["q_proj_moe_gen", "mlp_moe_gen.down_proj"], seed=0, scale=0.5)
    engine = BagelEngine(tiny_bagel_dir, merge_lora="device")
    try:
        groups = sample_both_ways(bagel_engine, engine, request, adapter, aio)
    finally:
        aio(engine.close())
    assert_merged_is_the_adapter(groups, version=3)


def test_the_trainer_bench_s_shaped_group_is_shaped_as_the_engine_s(bagel_engine, aio, tiny_bagel_dir):
    """`jobs.bench_train_step` trains on random groups of the engine's shapes (the cost depends on nothing else)."""
    from app.models.bagel.context import shaped_trajectory

    request = GenerationRequest("a red cube", n=3, **SAMPLING, guidance_scale=4.0, negative_prompt=" ")
    real = aio(bagel_engine.generate(request))
    shaped = shaped_trajectory(tiny_bagel_dir, request, bagel_engine.model.config, torch.Generator().manual_seed(0),
                               text_tokens=7)
    for name in ("images", "latents", "log_probs", "timesteps", "sigmas"):
        got, want = getattr(shaped, name), getattr(real, name)
        assert (got.shape, got.dtype) == (want.shape, want.dtype), name
    assert torch.equal(shaped.sigmas, real.sigmas) and shaped.family == real.family == "bagel"
    assert shaped.conditioning.keys() == real.conditioning.keys() == {"prompt_ids", "negative_ids", "image_tokens"}
    assert torch.equal(shaped.conditioning["image_tokens"], real.conditioning["image_tokens"])
    assert shaped.conditioning["prompt_ids"].shape == (7,) and shaped.conditioning["prompt_ids"].dtype == torch.int64
    with pytest.raises(ValueError, match="edits are not shaped"):
        shaped_trajectory(tiny_bagel_dir, request.replace(image=EDIT), bagel_engine.model.config,
                          torch.Generator())
