"""The tiny FLUX.1 checkpoint (FLUX.1-dev's layout and features at a tiny width), the family's operations against
diffusers' own pipeline, the FLOP count against torch's own counter, and the family's checks (checkpoint files,
prompt limit, the guidance input a guidance-distilled family requires)."""

import json

import pytest
import torch
from safetensors.torch import load_file
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from app.config import ConfigError, load
from app.models.flux import FAMILY
from app.models.flux import model as flux
from app.models.flux.flops import FluxTransformer, forward_flops
from app.models.flux.tiny import TRANSFORMER, build_tiny_flux
from app.types import GenerationRequest


@pytest.fixture(scope="module")
def pipe(tiny_flux_dir):
    from diffusers import FluxPipeline

    p = FluxPipeline.from_pretrained(tiny_flux_dir, dtype=torch.float32)
    p.set_progress_bar_config(disable=True)
    return p


def test_the_tiny_checkpoint_has_flux1_dev_s_layout_and_features(tiny_flux_dir, tiny_sd3_dir, pipe):
    index = json.loads((tiny_flux_dir / "model_index.json").read_text())
    assert index["_class_name"] == "FluxPipeline" and {"text_encoder", "text_encoder_2", "tokenizer_2"} <= set(index)
    config = pipe.transformer.config
    assert config.guidance_embeds and config.in_channels == 4 * pipe.vae.config.latent_channels  # 2x2 packed
    assert len(pipe.transformer.transformer_blocks) == 2 and len(pipe.transformer.single_transformer_blocks) == 2
    assert sum(config.axes_dims_rope) == config.attention_head_dim
    assert pipe.text_encoder_2.config.d_model == config.joint_attention_dim
    assert pipe.text_encoder.config.hidden_size == config.pooled_projection_dim
    assert pipe.scheduler.config.use_dynamic_shifting  # shifted by the image's token count, as FLUX.1-dev's
    assert FAMILY.checkpoint_problem(tiny_flux_dir) is None
    assert "missing text_encoder_2/config.json" not in (FAMILY.checkpoint_problem(tiny_sd3_dir) or "")


def test_same_seed_gives_identical_tensors_and_other_seed_differs(tmp_path, tiny_flux_dir):
    again = build_tiny_flux(tmp_path / "again", seed=0)
    other = build_tiny_flux(tmp_path / "other", seed=1)
    for part in ("transformer", "text_encoder_2", "vae"):
        (weights,) = (tiny_flux_dir / part).glob("*.safetensors")
        a, b, c = (load_file(d / part / weights.name) for d in (tiny_flux_dir, again, other))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        assert any(not torch.equal(a[k], c[k]) for k in a)


def test_the_schedule_and_the_first_noise_are_the_pipeline_s(pipe):
    """Our schedule (shifted by mu of 64 image tokens) and initial latents are what FluxPipeline draws."""
    from diffusers.pipelines.flux.pipeline_flux import retrieve_timesteps

    tokens = flux.image_tokens(128, 128)
    timesteps, sigmas = flux.schedule(pipe.scheduler, 6, tokens)
    reference, _ = retrieve_timesteps(pipe.scheduler, 6, sigmas=[1 - i / 6 for i in range(6)], mu=flux.calculate_shift(
        tokens, 256, 4096, 0.5, 1.15))
    assert torch.allclose(timesteps, reference.float()) and sigmas[0] == 1 and sigmas[-1] == 0
    generators = [torch.Generator().manual_seed(s) for s in (3, 4)]
    ours = flux.initial_latents(generators, 16, 128, 128, torch.float32)
    theirs, ids = pipe.prepare_latents(2, 16, 128, 128, torch.float32, "cpu",
                                       [torch.Generator().manual_seed(s) for s in (3, 4)])
    assert torch.equal(ours, theirs) and torch.equal(flux.image_ids(128, 128), ids)


def test_a_prompt_over_t5_s_limit_is_named(tiny_flux_dir):
    check = FAMILY.prompt_checker(tiny_flux_dir)
    fields = dict(height=64, width=64, num_inference_steps=2, noise_level=0.7, sde_type="sde",
                  embedded_guidance_scale=3.5)
    assert check(GenerationRequest('a sign that says "OPEN"', **fields)) is None
    field, why = check(GenerationRequest("word " * 200, **fields))
    assert field == "prompt" and "T5 tokens" in why and str(flux.T5_MAX_LENGTH) in why


def test_a_guidance_distilled_family_needs_its_guidance_input_and_the_others_refuse_one():
    config = load("configs/tiny_cpu.yaml", ["model.family=flux", "rollout.embedded_guidance_scale=3.5",
                                            "model.path=.cache/tiny-flux"])
    assert config.rollout.request("a cat").embedded_guidance_scale == 3.5
    with pytest.raises(ConfigError, match="guidance-distilled: set its guidance input"):
        load("configs/tiny_cpu.yaml", ["model.family=flux", "model.path=.cache/tiny-flux"])
    with pytest.raises(ConfigError, match="takes no guidance input"):
        load("configs/tiny_cpu.yaml", ["rollout.embedded_guidance_scale=3.5"])
    with pytest.raises(ValueError, match="embedded_guidance_scale"):
        GenerationRequest("a cat", height=64, width=64, num_inference_steps=2, noise_level=0.7, sde_type="sde",
                          embedded_guidance_scale=-1.0)


@pytest.mark.parametrize("config,side,text_tokens", [
    (TRANSFORMER, 8, 12),
    ({**TRANSFORMER, "num_layers": 1, "num_single_layers": 3, "attention_head_dim": 16, "axes_dims_rope": (4, 6, 6),
      "guidance_embeds": False}, 4, 30),
])
def test_forward_flops_equal_torch_s_count_of_a_real_forward(config, side, text_tokens):
    from diffusers import FluxTransformer2DModel

    transformer = FluxTransformer2DModel(**config).eval()
    guidance = torch.tensor([3.5]) if config["guidance_embeds"] else None
    inputs = dict(hidden_states=torch.randn(1, side * side, config["in_channels"]),
                  encoder_hidden_states=torch.randn(1, text_tokens, config["joint_attention_dim"]),
                  pooled_projections=torch.randn(1, config["pooled_projection_dim"]), timestep=torch.tensor([0.5]),
                  img_ids=torch.zeros(side * side, 3), txt_ids=torch.zeros(text_tokens, 3), guidance=guidance)
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        transformer(**inputs)
    assert forward_flops(FluxTransformer.from_config(transformer.config), side * side, text_tokens) == \
        counter.get_total_flops()


def test_flux1_dev_s_published_size_and_a_512_forward():
    """19 double and 38 single blocks of 24 heads of 128 (3072 wide): 11.9B parameters; a 512² image (1024
    tokens beside flow_grpo's 128 T5 tokens) costs 15.8 TFLOP a forward, one forward a step (guidance-distilled): a
    token meets 12·3072² weights in a block of either kind (its stream's half of a double block),
    2·12·d²·1152·57 = 14.9T, plus attention over the 1152 tokens, 4·1152²·d·57 = 0.93T."""
    from diffusers import FluxTransformer2DModel

    dev = dict(in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128, num_attention_heads=24,
               joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True, axes_dims_rope=(16, 56, 56))
    with torch.device("meta"):
        transformer = FluxTransformer2DModel(**dev)
    assert round(sum(p.numel() for p in transformer.parameters()) / 1e9, 1) == 11.9
    model = FluxTransformer.from_config(dev)
    flops = forward_flops(model, flux.image_tokens(512, 512), flux.T5_MAX_LENGTH)
    assert flops / 1e12 == pytest.approx(15.8, abs=0.05)
