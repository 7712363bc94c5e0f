"""The diffusers reference engine's adapters: versions, a change of rank/targets, and back to the base model."""

import pytest
import torch
from diffusers import QwenImageTransformer2DModel
from merging import assert_merged_is_the_adapter, sample_both_ways

from app.models.lora import LoraShape, random_lora
from app.rollout.diffusers_engine import DiffusersEngine
from app.types import GenerationRequest


def test_adapters_switch_and_unload(diffusers_engine, aio, tiny_model_dir):
    request = GenerationRequest("a red cube", n=2, height=64, width=64, num_inference_steps=2, noise_level=0.7,
                                sde_type="sde", seed=1)
    base = aio(diffusers_engine.generate(request))
    transformer = QwenImageTransformer2DModel.from_pretrained(tiny_model_dir, subfolder="transformer")
    first = random_lora(transformer, version=1, rank=4, target_modules=["to_q"], seed=0, scale=0.5)
    second = random_lora(transformer, version=2, rank=2, target_modules=["to_q", "to_v"], seed=1, scale=0.5)
    try:
        aio(diffusers_engine.load_lora(first))
        a = aio(diffusers_engine.generate(request))
        aio(diffusers_engine.load_lora(second))  # another rank and targets: a fresh adapter
        b = aio(diffusers_engine.generate(request))
    finally:
        aio(diffusers_engine.load_lora(None))
    unloaded = aio(diffusers_engine.generate(request))
    assert (a.lora_version, b.lora_version, unloaded.lora_version) == (1, 2, 0)
    assert not torch.equal(a.latents, base.latents) and not torch.equal(b.latents, a.latents)
    assert torch.equal(unloaded.latents, base.latents)


def test_an_adapter_published_mid_group_waits_for_the_next_group(diffusers_engine, aio, tiny_model_dir):
    """Publishing never waits for generation: `load_lora` returns while a group is being sampled (the engine's lock
    is still held when it does), that group finishes with the adapter it started with (the base model's exact
    samples), and the next group applies the new one first (timed: `producer["adapter_swap_s"]`)."""
    import threading
    import time

    request = GenerationRequest("a red cube", n=4, height=64, width=64, num_inference_steps=150, noise_level=0.7,
                                sde_type="sde", seed=3)
    base = aio(diffusers_engine.generate(request))
    transformer = QwenImageTransformer2DModel.from_pretrained(tiny_model_dir, subfolder="transformer")
    adapter = random_lora(transformer, version=4, rank=4, target_modules=["to_q"], seed=0, scale=0.5)
    in_flight = {}
    sampling = threading.Thread(target=lambda: in_flight.update(traj=diffusers_engine.sample(request)))
    try:
        sampling.start()
        deadline = time.monotonic() + 30
        while not diffusers_engine._lock.locked() and time.monotonic() < deadline:
            time.sleep(0.001)
        assert aio(diffusers_engine.load_lora(adapter)) == 4
        assert diffusers_engine._lock.locked() and sampling.is_alive()  # returned while the group was sampled
        assert diffusers_engine.lora_version == 4  # what a group started now gets
        sampling.join(timeout=120)
        after = aio(diffusers_engine.generate(request))
    finally:
        aio(diffusers_engine.load_lora(None))
    first = in_flight["traj"]
    assert first.lora_version == 0 and torch.equal(first.latents, base.latents)
    assert after.lora_version == 4 and not torch.equal(after.latents, base.latents)
    assert after.producer["adapter_swap_s"] > 0 and first.producer["adapter_swap_s"] == 0


def test_an_engine_of_a_runs_lora_holds_it_from_the_start_frozen(diffusers_engine, aio, tiny_model_dir):
    """A replica built from a run's model section (`lora`: rank, alpha, targets) holds that adapter from its first
    group with B = 0, which samples the base model exactly; through adapters and back to the base model its modules
    stay the same and every parameter frozen. A compiled block is guarded on both: on the GPU the first trained
    adapter compiled a replica again (its LoRA layers appeared, and peft marked the base frozen)."""
    request = GenerationRequest("a red cube", n=2, height=64, width=64, num_inference_steps=2, noise_level=0.7,
                                sde_type="sde", seed=1)
    base = aio(diffusers_engine.generate(request))  # an engine with no adapter at all
    engine = DiffusersEngine(tiny_model_dir, lora=LoraShape(4, 4.0, ("to_q",)))
    aio(engine.start())
    try:
        module = engine.trained_module()
        structure = [name for name, _ in module.named_modules()]
        assert any(".lora_B." in name for name in structure)
        zero = aio(engine.generate(request))
        transformer = QwenImageTransformer2DModel.from_pretrained(tiny_model_dir, subfolder="transformer")
        aio(engine.load_lora(random_lora(transformer, version=1, rank=4, target_modules=["to_q"], seed=0, scale=0.5)))
        tuned = aio(engine.generate(request))
        aio(engine.load_lora(None))
        again = aio(engine.generate(request))
    finally:
        aio(engine.close())
    assert (zero.lora_version, tuned.lora_version, again.lora_version) == (0, 1, 0)
    assert torch.equal(zero.latents, base.latents) and torch.equal(again.latents, base.latents)
    assert not torch.equal(tuned.latents, base.latents)
    assert [name for name, _ in module.named_modules()] == structure
    assert not any(p.requires_grad for p in module.parameters())


@pytest.mark.parametrize("keep_on", ["device", "host"])
def test_an_engine_that_merges_samples_what_the_adapter_samples(diffusers_engine, aio, tiny_model_dir, keep_on):
    """`rollout.merge_lora`: the adapter folded into the weights, no peft layers in the module, which stays frozen.
    In fp32 its groups are the peft adapter's to rounding, the base model's bit for bit after `load_lora(None)`;
    new base weights (`update_weights`) take the adapter again, and unknown ones are refused. Host copies of the
    run's target layers are taken from the start (the adapter here adapts two layers more, copied when it comes)."""
    request = GenerationRequest("a red cube", n=2, height=64, width=64, num_inference_steps=3, noise_level=0.7,
                                sde_type="sde", seed=4)
    transformer = QwenImageTransformer2DModel.from_pretrained(tiny_model_dir, subfolder="transformer")
    adapter = random_lora(transformer, version=3, rank=4, target_modules=["to_q", "to_v", "img_mlp.net.2"], seed=2,
                          scale=0.5)
    engine = DiffusersEngine(tiny_model_dir, lora=LoraShape(4, 4.0, ("to_q",)), merge_lora=keep_on)
    try:
        aio(engine.start())
        engine._merged._wait_ahead()
        ahead = set(engine._merged.base)
        groups = sample_both_ways(diffusers_engine, engine, request, adapter, aio)
        module = engine.trained_module()
        assert not any("lora_" in name for name, _ in module.named_modules())
        assert aio(engine.health())["lora_merged"]
        weights = {"transformer_blocks.0.attn.to_q.weight": 1.5 * transformer.transformer_blocks[0].attn.to_q.weight}
        aio(engine.load_lora(adapter))
        assert aio(engine.update_weights(weights)) == 1
        reloaded = aio(engine.generate(request))
        with pytest.raises(ValueError, match="unknown transformer weights"):
            aio(engine.update_weights({"transformer_blocks.0.attn.nowhere.weight": torch.zeros(2, 2)}))
    finally:
        aio(engine.close())
    assert_merged_is_the_adapter(groups, version=3)
    to_q = {n for n in engine._merged.base if n.endswith(".to_q")}
    assert ahead == (to_q if keep_on == "host" else set()) and to_q
    assert set(groups["merged"].producer["phase_s"]) == {"encode", "denoise", "decode"}  # where its time went
    assert reloaded.lora_version == 3 and not torch.equal(reloaded.latents, groups["merged"].latents)
    assert not any(p.requires_grad for p in module.parameters())


def test_new_weights_reach_an_adapted_layer_and_a_bad_name_changes_nothing(tiny_model_dir, aio):
    """`update_weights` on an engine holding a peft adapter: a layer the adapter wraps takes its weight by the base
    model's name (peft keeps it as `base_layer`); a set with one unknown name is refused whole, before any weight
    is written."""
    request = GenerationRequest("a red cube", n=2, height=64, width=64, num_inference_steps=2, noise_level=0.7,
                                sde_type="sde", seed=1)
    transformer = QwenImageTransformer2DModel.from_pretrained(tiny_model_dir, subfolder="transformer")
    name = "transformer_blocks.0.attn.to_q.weight"
    doubled = 2.0 * transformer.transformer_blocks[0].attn.to_q.weight.detach()
    engine = DiffusersEngine(tiny_model_dir, lora=LoraShape(4, 4.0, ("to_q",)))
    aio(engine.start())
    try:
        before = aio(engine.generate(request))
        with pytest.raises(ValueError, match=r"unknown transformer weights: \['transformer_blocks.0.attn.nowhere"):
            aio(engine.update_weights({name: doubled, "transformer_blocks.0.attn.nowhere.weight": doubled}))
        refused = aio(engine.generate(request))
        assert aio(engine.update_weights({name: doubled})) == 1
        updated = aio(engine.generate(request))
        held = engine.trained_module().transformer_blocks[0].attn.to_q.base_layer.weight
    finally:
        aio(engine.close())
    assert torch.equal(refused.latents, before.latents) and not torch.equal(updated.latents, before.latents)
    assert torch.equal(held, doubled)
