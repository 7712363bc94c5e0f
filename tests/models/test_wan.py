"""The tiny Wan checkpoint (Wan2.1's layout and features at a tiny width), the family's operations against
diffusers' own pipeline, the FLOP count against torch's own counter, the real sizes, and the family's checks
(checkpoint files, prompt limit, frame counts: a video family requires them, an image family refuses them)."""

import json

import pytest
import torch
from safetensors.torch import load_file
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from app.config import ConfigError, load
from app.models.family import get_family
from app.models.wan import FAMILY
from app.models.wan import model as wan
from app.models.wan.flops import WanTransformer, forward_flops
from app.models.wan.tiny import TRANSFORMER, build_tiny_wan
from app.types import GenerationRequest, RequestError

FIELDS = dict(height=64, width=64, num_inference_steps=2, noise_level=0.7, sde_type="sde")


@pytest.fixture(scope="module")
def pipe(tiny_wan_dir):
    from diffusers import WanPipeline

    p = WanPipeline.from_pretrained(tiny_wan_dir, dtype=torch.float32)
    p.set_progress_bar_config(disable=True)
    return p


def test_the_tiny_checkpoint_has_wan_s_layout_and_features(tiny_wan_dir, pipe):
    index = json.loads((tiny_wan_dir / "model_index.json").read_text())
    assert index["_class_name"] == "WanPipeline" and {"text_encoder", "tokenizer", "transformer", "vae"} <= set(index)
    config = pipe.transformer.config
    assert config.text_dim == pipe.text_encoder.config.d_model and tuple(config.patch_size) == wan.PATCH
    assert pipe.vae_scale_factor_temporal == wan.TEMPORAL_FACTOR and pipe.vae_scale_factor_spatial == 8
    assert wan.pipeline_settings(tiny_wan_dir) == {"expand_timesteps": False, "flow_shift": 3.0}
    assert FAMILY.checkpoint_problem(tiny_wan_dir) is None and FAMILY.video


def test_same_seed_gives_identical_tensors_and_other_seed_differs(tmp_path, tiny_wan_dir):
    again = build_tiny_wan(tmp_path / "again", seed=0)
    other = build_tiny_wan(tmp_path / "other", seed=1)
    for part in ("transformer", "text_encoder", "vae"):
        (weights,) = (tiny_wan_dir / part).glob("*.safetensors")
        a, b, c = (load_file(d / part / weights.name) for d in (tiny_wan_dir, again, other))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        assert any(not torch.equal(a[k], c[k]) for k in a)


def test_the_schedule_the_first_noise_and_the_states_are_the_pipeline_s(pipe):
    timesteps, sigmas = wan.schedule(3.0, 6)
    pipe.scheduler.set_timesteps(6)  # Wan's own UniPC on flow sigmas: the same points within 2e-3
    assert torch.allclose(sigmas, pipe.scheduler.sigmas, atol=2e-3) and sigmas[0] == 1 and sigmas[-1] == 0
    line = torch.linspace(1, 1 / 6, 6)
    assert torch.allclose(sigmas[:-1], 3 * line / (1 + 2 * line)) and torch.equal(timesteps, sigmas[:-1] * 1000)
    shape = wan.latent_shape(16, 9, 64, 96, 8)
    assert shape == (16, 3, 8, 12) and wan.video_tokens(shape) == 3 * 4 * 6
    ours = wan.initial_latents([torch.Generator().manual_seed(s) for s in (3, 4)], shape)
    theirs = pipe.prepare_latents(2, 16, 64, 96, 9, torch.float32, "cpu",
                                  [torch.Generator().manual_seed(s) for s in (3, 4)])
    assert torch.equal(ours, theirs)
    (states,), _ = pipe.encode_prompt("a red cube", do_classifier_free_guidance=False, device="cpu",
                                      max_sequence_length=wan.MAX_SEQUENCE_LENGTH)
    assert states.shape[0] == wan.MAX_SEQUENCE_LENGTH and states[-1].abs().sum() == 0  # padded with zeros


@pytest.mark.parametrize("scale", [1.0, 4.0])
@pytest.mark.parametrize("expand", [False, True])
def test_the_velocity_is_wan_s_cfg_whatever_the_timestep_s_form(pipe, scale, expand):
    """v = neg + s·(pos − neg) in fp32, a forward a branch; a timestep a token (Wan2.2-TI2V) is the same velocity."""
    torch.manual_seed(0)
    x, pos, neg = torch.randn(2, 16, 3, 4, 4), torch.randn(2, 7, 32), torch.randn(2, 7, 32)
    v = wan.velocity(pipe.transformer, x, torch.tensor(750.0), pos, dtype=torch.float32, guidance_scale=scale,
                     negative_embeds=neg, expand_timesteps=expand)
    with torch.no_grad():
        def out(states):
            return pipe.transformer(hidden_states=x, timestep=torch.full((2,), 750.0), encoder_hidden_states=states,
                                    return_dict=False)[0]

        p, n = out(pos), out(neg)
    expected = p if scale == 1 else n + scale * (p - n)
    assert torch.allclose(v, expected, atol=1e-5)


def test_a_denoiser_loaded_in_bf16_rescores_a_trajectory_in_bf16(tiny_wan_dir):
    """diffusers keeps Wan's norms, time embedder and scale_shift_table (its first parameter) in fp32: the recompute
    computes in the model's dtype, not its first parameter's (a real-size bench once fed fp32 latents to its bf16
    patch embedding)."""
    family = get_family("wan")
    denoiser = family.load_denoiser(tiny_wan_dir, dtype=torch.bfloat16, device=torch.device("cpu"))
    assert next(denoiser.parameters()).dtype == torch.float32 and denoiser.dtype == torch.bfloat16
    request = GenerationRequest("a cat", n=2, num_frames=5, guidance_scale=4.0, negative_prompt=" ", **FIELDS)
    traj = family.shaped_trajectory(tiny_wan_dir, request, family.denoiser_config(tiny_wan_dir),
                                    torch.Generator().manual_seed(0))
    with torch.no_grad():
        (out,) = family.score_trajectory(denoiser, traj, [0], [0, 1])
    assert out.log_prob.shape == (2,) and out.log_prob.isfinite().all()


def test_frame_counts_a_video_family_requires_and_an_image_family_refuses():
    video = GenerationRequest("a cat", num_frames=33, **FIELDS)
    image = GenerationRequest("a cat", **FIELDS)
    assert FAMILY.request_problem(video) is None
    assert FAMILY.request_problem(image) == ("num_frames", "is required: model.family=wan generates videos (e.g. 33 "
                                                           "or 81 frames)")
    field, why = FAMILY.request_problem(video.replace(num_frames=32))
    assert field == "num_frames" and "4k + 1" in why
    field, why = get_family("qwen_image").request_problem(video)
    assert field == "num_frames" and "generates images" in why
    with pytest.raises(RequestError, match=r"num_frames=0: must be an integer in \[1, 257\]") as err:
        GenerationRequest("a cat", num_frames=0, **FIELDS)
    assert err.value.field == "num_frames"


def test_a_run_config_names_a_frame_count_its_family_cannot_take():
    with pytest.raises(ConfigError, match=r"rollout.num_frames=None: is required: model.family=wan"):
        load("configs/tiny_wan_cpu.yaml", ["rollout.num_frames=null"])
    with pytest.raises(ConfigError, match=r"rollout.num_frames=8: must be 4k \+ 1 frames"):
        load("configs/tiny_wan_cpu.yaml", ["rollout.num_frames=8"])
    with pytest.raises(ConfigError, match=r"rollout.num_frames=9: model.family=qwen_image generates images"):
        load("configs/tiny_cpu.yaml", ["rollout.num_frames=9"])


def test_vllm_omni_serves_wan_and_a_family_without_its_pipeline_is_refused(monkeypatch):
    import dataclasses

    from app import config
    from app.models.family import VllmOmniRecipe, get_family

    assert load("configs/tiny_wan_cpu.yaml").rollout.engine == "vllm_omni"
    unbuilt = dataclasses.replace(FAMILY, vllm_omni=VllmOmniRecipe(pipeline_class=None))
    monkeypatch.setattr(config, "get_family", lambda name: unbuilt if name == "wan" else get_family(name))
    with pytest.raises(ConfigError, match="model.family=wan on vllm-omni .* is not there yet; use "
                                          "rollout.engine=diffusers"):
        load("configs/tiny_wan_cpu.yaml")


def test_a_prompt_over_umt5_s_limit_is_named(tiny_wan_dir):
    check = FAMILY.prompt_checker(tiny_wan_dir)
    assert check(GenerationRequest('a sign that says "OPEN"', num_frames=9, **FIELDS)) is None
    field, why = check(GenerationRequest("zebra " * 600, num_frames=9, **FIELDS))
    assert field == "prompt" and str(wan.MAX_SEQUENCE_LENGTH) in why


@pytest.mark.parametrize("config,frames,side", [
    (TRANSFORMER, 3, 8),
    ({**TRANSFORMER, "num_layers": 3, "num_attention_heads": 3, "ffn_dim": 96, "in_channels": 48,
      "out_channels": 48}, 2, 16),  # Wan2.2's 48 channels, deeper, wider
])
def test_forward_flops_equal_torch_s_count_of_a_real_forward(config, frames, side):
    from diffusers import WanTransformer3DModel

    transformer = WanTransformer3DModel(**config).eval()
    x = torch.randn(1, config["in_channels"], frames, side, side)
    text = torch.randn(1, 24, config["text_dim"])
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        transformer(hidden_states=x, timestep=torch.tensor([500.0]), encoder_hidden_states=text)
    tokens = frames * (side // 2) ** 2
    assert forward_flops(WanTransformer.from_config(transformer.config), tokens, 24) == counter.get_total_flops()


@pytest.mark.parametrize("preset,billions", [("wan2.1-t2v-1.3b", 1.4), ("wan2.2-ti2v-5b", 5.0)])
def test_the_published_sizes(preset, billions):
    """Wan2.1-T2V-1.3B: 30 blocks 1536 wide; Wan2.2-TI2V-5B: 30 blocks 3072 wide, 48 latent channels."""
    from diffusers import WanTransformer3DModel

    from app.models.wan.real_size import MODELS

    with torch.device("meta"):
        transformer = WanTransformer3DModel(**MODELS[preset]["transformer"], num_layers=30)
    assert round(sum(p.numel() for p in transformer.parameters()) / 1e9, 1) == billions
