"""The tiny Z-Image checkpoint (Z-Image's layout and features at a tiny width), the family's operations against
diffusers' own pipeline, the FLOP count against torch's own counter, and the family's checks (checkpoint files,
prompt limit, Z-Image's own guidance scale)."""

import json

import pytest
import torch
from safetensors.torch import load_file
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from app.models.z_image import FAMILY
from app.models.z_image import model as z_image
from app.models.z_image.flops import ZImageTransformer, forward_flops
from app.models.z_image.tiny import TRANSFORMER, build_tiny_z_image
from app.types import GenerationRequest


@pytest.fixture(scope="module")
def pipe(tiny_z_image_dir):
    from diffusers import ZImagePipeline

    p = ZImagePipeline.from_pretrained(tiny_z_image_dir, dtype=torch.float32)
    p.set_progress_bar_config(disable=True)
    return p


def test_the_tiny_checkpoint_has_z_image_s_layout_and_features(tiny_z_image_dir, pipe):
    index = json.loads((tiny_z_image_dir / "model_index.json").read_text())
    assert index["_class_name"] == "ZImagePipeline" and {"text_encoder", "tokenizer", "transformer"} <= set(index)
    config = pipe.transformer.config
    assert config.cap_feat_dim == pipe.text_encoder.config.hidden_size
    assert len(pipe.transformer.layers) == 2 and len(pipe.transformer.noise_refiner) == 1
    assert sum(config.axes_dims) == config.dim // config.n_heads
    assert not pipe.scheduler.config.use_dynamic_shifting and pipe.scheduler.config.shift == 3.0  # Z-Image-Turbo's
    assert FAMILY.checkpoint_problem(tiny_z_image_dir) is None
    wrapped = pipe.tokenizer.apply_chat_template([{"role": "user", "content": "a cat"}], tokenize=False,
                                                 add_generation_prompt=True, enable_thinking=True)
    assert wrapped == "<|im_start|>user\na cat<|im_end|>\n<|im_start|>assistant\n"  # Qwen3's, thinking on


def test_same_seed_gives_identical_tensors_and_other_seed_differs(tmp_path, tiny_z_image_dir):
    again = build_tiny_z_image(tmp_path / "again", seed=0)
    other = build_tiny_z_image(tmp_path / "other", seed=1)
    for part in ("transformer", "text_encoder", "vae"):
        (weights,) = (tiny_z_image_dir / part).glob("*.safetensors")
        a, b, c = (load_file(d / part / weights.name) for d in (tiny_z_image_dir, again, other))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        assert any(not torch.equal(a[k], c[k]) for k in a)


def test_the_schedule_the_first_noise_and_the_captions_are_the_pipeline_s(pipe):
    from diffusers.pipelines.z_image.pipeline_z_image import get_default_z_image_sigmas, retrieve_timesteps

    timesteps, sigmas = z_image.schedule(pipe.scheduler, 6, z_image.image_tokens(128, 128))
    reference, _ = retrieve_timesteps(pipe.scheduler, 6, sigmas=get_default_z_image_sigmas(6), mu=0.7)
    assert torch.equal(timesteps, reference.float()) and sigmas[0] == 1 and sigmas[-1] == 0
    generators = [torch.Generator().manual_seed(s) for s in (3, 4)]
    ours = z_image.initial_latents(generators, 16, 128, 128)
    theirs = pipe.prepare_latents(2, 16, 128, 128, torch.float32, "cpu",
                                  [torch.Generator().manual_seed(s) for s in (3, 4)])
    assert torch.equal(ours, theirs) and ours.shape == (2, 16, 16, 16)
    (caption,), _ = pipe.encode_prompt("a red cube", device="cpu", do_classifier_free_guidance=False)
    assert caption.ndim == 2 and caption.shape[0] < z_image.MAX_SEQUENCE_LENGTH  # its own tokens, no padding


@pytest.mark.parametrize("scale", [1.0, 4.0])
def test_the_velocity_is_z_image_s_cfg_with_its_scale_one_below_ours(pipe, scale):
    """v = −(pos + (s − 1)·(pos − neg)) in fp32: Z-Image's CFG at its own scale s − 1 (one forward at s = 1)."""
    torch.manual_seed(0)
    x, pos, neg = torch.randn(2, 16, 8, 8), torch.randn(5, 32), torch.randn(3, 32)
    t = torch.tensor(750.0)
    v = z_image.velocity(pipe.transformer, x, t, [pos, pos], dtype=torch.float32, guidance_scale=scale,
                         negative_captions=[neg, neg])
    with torch.no_grad():
        def out(caption):
            return torch.stack(pipe.transformer(list(x.unsqueeze(2).unbind(0)), torch.full((2,), 0.25),
                                                [caption, caption], return_dict=False)[0]).squeeze(2)

        p, n = out(pos), out(neg)
    expected = -p if scale == 1 else -(p + (scale - 1) * (p - n))
    assert torch.allclose(v, expected, atol=1e-5)


def test_a_prompt_over_the_text_encoder_s_limit_is_named(tiny_z_image_dir):
    check = FAMILY.prompt_checker(tiny_z_image_dir)
    fields = dict(height=64, width=64, num_inference_steps=2, noise_level=0.7, sde_type="sde")
    assert check(GenerationRequest('a sign that says "OPEN"', **fields)) is None
    field, why = check(GenerationRequest("zebra " * 600, **fields))
    assert field == "prompt" and "chat template" in why and str(z_image.MAX_SEQUENCE_LENGTH) in why
    field, _ = check(GenerationRequest("a cat", guidance_scale=4.0, negative_prompt="zebra " * 600, **fields))
    assert field == "negative_prompt"


@pytest.mark.parametrize("config,side,caption_tokens", [
    (TRANSFORMER, 8, 12),  # both sequences padded to 32
    ({**TRANSFORMER, "n_layers": 3, "n_refiner_layers": 2, "dim": 48, "n_heads": 3, "axes_dims": [4, 6, 6]}, 16,
     64),  # deeper, wider, no padding
])
def test_forward_flops_equal_torch_s_count_of_a_real_forward(config, side, caption_tokens):
    from diffusers import ZImageTransformer2DModel

    transformer = ZImageTransformer2DModel(**config).eval()
    x = [torch.randn(config["in_channels"], 1, side, side)]
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        transformer(x, torch.tensor([0.5]), [torch.randn(caption_tokens, config["cap_feat_dim"])])
    tokens = (side // 2) ** 2
    assert forward_flops(ZImageTransformer.from_config(transformer.config), tokens, caption_tokens) == \
        counter.get_total_flops()


def test_z_image_s_published_size():
    """30 blocks 3840 wide, 2 refiners of each kind: 6.2B parameters."""
    from diffusers import ZImageTransformer2DModel

    from app.models.z_image.real_size import TRANSFORMER as REAL

    with torch.device("meta"):
        transformer = ZImageTransformer2DModel(**REAL)
    assert round(sum(p.numel() for p in transformer.parameters()) / 1e9, 1) == 6.2
