"""vllm-omni's start-up warm-up asks for 512 pixels; a BAGEL checkpoint whose latent grid holds fewer (every tiny
one, the real autoencoder's too) gets the small warm-up on every platform, or vllm-omni's own admission check
refuses its warm-up and the engine never starts (seen on an H200 with the thinker's tiny checkpoint)."""

import json
from types import SimpleNamespace

import pytest

from app.platform.vllm_omni.warmup import WARMUP_REQUEST_SIDE


def od_config(tmp_path, max_latent_size: int, model_class_name: str = "BagelPipeline", **extra):
    (tmp_path / "config.json").write_text(json.dumps(
        {"vae_config": {"z_channels": 16, "downsample": 8}, "latent_patch_size": 2,
         "max_latent_size": max_latent_size} | extra))
    return SimpleNamespace(model=str(tmp_path), model_class_name=model_class_name)


@pytest.mark.parametrize("max_latent_size,small", [(8, True), (31, True), (32, False), (64, False)])
def test_a_bagel_checkpoint_under_the_warmups_size_gets_the_small_warmup(tmp_path, max_latent_size, small):
    from app.rollout.vllm_omni.pipeline_bagel import _under_warmup_size

    assert (max_latent_size * 16 < WARMUP_REQUEST_SIDE) is small  # the side the checkpoint can generate
    assert _under_warmup_size(od_config(tmp_path, max_latent_size)) is small
    # a tiny autoencoder declared or not (the thinker's tiny checkpoint carries the real one): the grid decides
    assert _under_warmup_size(od_config(tmp_path, max_latent_size, flowgrpo_tiny_ae={"downsample": 8})) is small


def test_other_pipelines_keep_vllm_omnis_warmup(tmp_path):
    from app.rollout.vllm_omni.pipeline_bagel import _under_warmup_size

    assert _under_warmup_size(od_config(tmp_path, 8, model_class_name="QwenImagePipeline")) is False
