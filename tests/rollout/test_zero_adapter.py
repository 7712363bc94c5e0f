"""The zero adapter a compiled vllm-omni replica serves for the base model (`app.rollout.vllm_omni.lora.zero_lora`)
has the layers and shapes of the adapters the trainer publishes, read from the checkpoint's headers, and is the base
model: every B zero. A layer it missed or shaped otherwise would put vLLM's LoRA layers on other modules than the
trained adapter's, and the first published adapter would compile again (docs/fast_recipes.md)."""

import pytest
import torch

from app.models.family import get_family
from app.models.lora import random_lora
from app.rollout.vllm_omni.lora import BASE_LORA_ID, zero_lora

FAMILIES = {"qwen_image": "tiny_model_dir", "sd3": "tiny_sd3_dir", "flux": "tiny_flux_dir",
            "z_image": "tiny_z_image_dir", "wan": "tiny_wan_dir"}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_zero_adapter_has_the_trained_adapters_layers_and_is_the_base_model(family, request):
    folder = request.getfixturevalue(FAMILIES[family])
    face = get_family(family)
    transformer = face.load_denoiser(folder, dtype=torch.float32, device=torch.device("cpu"))
    trained = random_lora(transformer, version=1, rank=4, target_modules=list(face.lora_targets), seed=0, scale=0.5)
    zero = zero_lora(folder, rank=4, alpha=8, target_modules=face.lora_targets, dtype=torch.bfloat16)

    assert {k: v.shape for k, v in zero.tensors.items()} == {k: v.shape for k, v in trained.tensors.items()}
    assert all(t.dtype == torch.bfloat16 and not t.any() for k, t in zero.tensors.items() if ".lora_B." in k)
    assert (zero.rank, zero.alpha, zero.version) == (4, 8, BASE_LORA_ID)
