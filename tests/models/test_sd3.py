"""The SD3 family's parts: the tiny checkpoint (deterministic, SD3.5's layout and features, loadable by diffusers,
tokenizers that cover our prompt sets), the FLOP count against torch's own counter, SD3.5-Medium's published sizes,
and the family's checks (checkpoint files, prompt limit, adapter files)."""

import json

import pytest
import torch
from safetensors.torch import load_file
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from app.models.family import get_family
from app.models.sd3 import FAMILY
from app.models.sd3 import model as sd3
from app.models.sd3.flops import SD3MMDiT, forward_flops
from app.models.sd3.real_size import TRANSFORMER as SD35_MEDIUM
from app.models.sd3.tiny import TRANSFORMER, build_tiny_sd3, train_clip_tokenizer, train_t5_tokenizer
from app.prompt_sets import load_prompts


@pytest.fixture(scope="module")
def pipe(tiny_sd3_dir):
    from diffusers import StableDiffusion3Pipeline

    p = StableDiffusion3Pipeline.from_pretrained(tiny_sd3_dir, dtype=torch.float32)
    p.set_progress_bar_config(disable=True)
    return p


def test_the_tiny_checkpoint_has_sd35_s_layout_and_features(tiny_sd3_dir, tiny_model_dir, pipe):
    index = json.loads((tiny_sd3_dir / "model_index.json").read_text())
    assert index["_class_name"] == "StableDiffusion3Pipeline"
    assert {"text_encoder", "text_encoder_2", "text_encoder_3", "tokenizer_3", "vae"} <= set(index)
    config = pipe.transformer.config
    assert config.qk_norm == "rms_norm" and tuple(config.dual_attention_layers) == (0,)
    blocks = pipe.transformer.transformer_blocks
    assert blocks[0].attn2 is not None and blocks[-1].context_pre_only and not blocks[0].context_pre_only
    # the text widths SD3 ties together: the CLIPs' states side by side fit T5's width; pooled = both projections
    clip = pipe.text_encoder.config.hidden_size + pipe.text_encoder_2.config.hidden_size
    assert clip <= pipe.text_encoder_3.config.d_model == config.joint_attention_dim
    assert (pipe.text_encoder.config.projection_dim + pipe.text_encoder_2.config.projection_dim
            == config.pooled_projection_dim)
    assert FAMILY.checkpoint_problem(tiny_sd3_dir) is None
    assert "missing text_encoder_3/config.json" in FAMILY.checkpoint_problem(tiny_model_dir)  # a Qwen-Image folder


def test_generates_with_cfg_and_encodes_prompts_apart(pipe):
    out = pipe('a sign that says "OPEN"', height=64, width=64, num_inference_steps=2, guidance_scale=4.5,
               max_sequence_length=sd3.T5_MAX_LENGTH, generator=torch.Generator().manual_seed(0), output_type="np")
    assert out.images[0].shape == (64, 64, 3) and out.images[0].std() > 0.01
    a, _, pooled_a, _ = pipe.encode_prompt("a red cube", None, None, do_classifier_free_guidance=False,
                                           max_sequence_length=sd3.T5_MAX_LENGTH)
    b, _, pooled_b, _ = pipe.encode_prompt("a blue sphere", None, None, do_classifier_free_guidance=False,
                                           max_sequence_length=sd3.T5_MAX_LENGTH)
    assert a.shape == (1, 77 + sd3.T5_MAX_LENGTH, 32) and pooled_a.shape == (1, 32)
    assert not torch.allclose(a, b) and not torch.allclose(pooled_a, pooled_b)


def test_same_seed_gives_identical_tensors_and_other_seed_differs(tmp_path, tiny_sd3_dir):
    again = build_tiny_sd3(tmp_path / "again", seed=0)
    other = build_tiny_sd3(tmp_path / "other", seed=1)
    for part in ("transformer", "text_encoder_3", "vae"):
        (weights,) = (tiny_sd3_dir / part).glob("*.safetensors")
        a, b = load_file(weights), load_file(again / part / weights.name)
        c = load_file(other / part / weights.name)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        assert any(not torch.equal(a[k], c[k]) for k in a)
    for tokenizer in ("tokenizer", "tokenizer_3"):
        assert (again / tokenizer / "tokenizer.json").read_text() == (tiny_sd3_dir / tokenizer /
                                                                      "tokenizer.json").read_text()


def test_the_tokenizers_read_every_prompt_without_unknown_pieces():
    clip, t5 = train_clip_tokenizer(), train_t5_tokenizer()
    prompts = [*load_prompts("ocr_tiny"), *load_prompts("ocr_eval")[:64], 'Zebra quiz #7 (x+y)/2 = 100%!']
    for prompt in prompts:
        clip_ids = clip(prompt).input_ids
        assert clip_ids[0] == clip.bos_token_id and clip_ids[-1] == clip.eos_token_id
        assert clip.eos_token_id not in clip_ids[1:-1], prompt  # CLIP's unknown token is its end token
        assert t5.unk_token_id not in t5(prompt).input_ids, prompt
    assert clip("OPEN").input_ids == clip("open").input_ids  # CLIP lower-cases; T5 does not
    assert t5("OPEN").input_ids != t5("open").input_ids


def test_a_prompt_over_t5_s_limit_is_named(tiny_sd3_dir):
    from app.types import GenerationRequest

    check = get_family("sd3").prompt_checker(tiny_sd3_dir)
    fields = dict(height=64, width=64, num_inference_steps=2, noise_level=0.7, sde_type="sde")
    assert check(GenerationRequest('a sign that says "OPEN"', **fields)) is None
    field, why = check(GenerationRequest("word " * 200, **fields))
    assert field == "prompt" and "T5 tokens" in why and str(sd3.T5_MAX_LENGTH) in why
    field, _ = check(GenerationRequest("a cat", guidance_scale=4.5, negative_prompt="blurry " * 200, **fields))
    assert field == "negative_prompt"


@pytest.mark.parametrize("config,image_side,text_tokens", [
    (TRANSFORMER, 8, 12),
    ({**TRANSFORMER, "num_layers": 3, "dual_attention_layers": (0, 1), "attention_head_dim": 16,
      "caption_projection_dim": 64}, 4, 30),
])
def test_forward_flops_equal_torch_s_count_of_a_real_forward(config, image_side, text_tokens):
    from diffusers import SD3Transformer2DModel

    transformer = SD3Transformer2DModel(**config).eval()
    inputs = dict(hidden_states=torch.randn(1, 16, image_side, image_side),
                  encoder_hidden_states=torch.randn(1, text_tokens, config["joint_attention_dim"]),
                  pooled_projections=torch.randn(1, config["pooled_projection_dim"]), timestep=torch.tensor([500.0]))
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        transformer(**inputs)
    image_tokens = (image_side // 2) ** 2
    assert forward_flops(SD3MMDiT.from_config(transformer.config), image_tokens, text_tokens) == \
        counter.get_total_flops()


def test_sd35_medium_s_published_sizes_and_a_512_forward():
    """24 blocks of 24 heads of 64, dual attention in blocks 0-12, text states 4096 wide: 2.24B parameters (2.47B
    with the 384² sin-cos position table); a 512² image (1024 tokens, 77 + 128 text tokens) costs 2.22 TFLOP per
    forward, flow_grpo's figure (2.2)."""
    from diffusers import SD3Transformer2DModel

    with torch.device("meta"):
        transformer = SD3Transformer2DModel(**SD35_MEDIUM)
    parameters = sum(p.numel() for p in transformer.parameters())
    table = transformer.pos_embed.pos_embed.numel()
    assert (round(parameters / 1e9, 2), round((parameters + table) / 1e9, 2)) == (2.24, 2.47)
    model = SD3MMDiT.from_config(SD35_MEDIUM)
    assert (model.num_layers, model.dim, model.text_dim, model.dual_layers) == (24, 1536, 4096, 13)
    flops = forward_flops(model, sd3.image_tokens(512, 512), 77 + sd3.T5_MAX_LENGTH)
    assert flops / 1e12 == pytest.approx(2.22, abs=0.005)
