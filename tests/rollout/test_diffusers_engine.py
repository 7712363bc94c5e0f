"""The diffusers reference engine's adapters: versions, a change of rank/targets, and back to the base model."""

import torch
from diffusers import QwenImageTransformer2DModel

from app.models.lora import random_lora
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
