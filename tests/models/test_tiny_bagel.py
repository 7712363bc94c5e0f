"""The tiny BAGEL builder: deterministic, upstream names, and an autoencoder that diffusers and vllm-omni both load
and decode alike."""

import json

import pytest
import torch
from safetensors.torch import load_file

from app.models.bagel import tiny as tiny_bagel
from app.models.bagel.flux_ae import diffusers_to_ldm_vae, load_flux_autoencoder
from app.models.bagel.tiny import TINY_AE, build_tiny_bagel

pytestmark = pytest.mark.slow  # fresh builds (~8 s each) and vllm-omni's import


@pytest.fixture(scope="module")
def bagel_dir(tmp_path_factory):
    return build_tiny_bagel(tmp_path_factory.mktemp("tiny-bagel") / "model", seed=0)


def test_same_seed_same_checkpoint_and_another_seed_another(bagel_dir, tmp_path):
    again = build_tiny_bagel(tmp_path / "again", seed=0)
    other = build_tiny_bagel(tmp_path / "other", seed=1)
    for name in ("ema.safetensors", "ae.safetensors"):
        first, second, third = (load_file(str(d / name)) for d in (bagel_dir, again, other))
        assert first.keys() == second.keys() == third.keys()
        assert all(torch.equal(first[k], second[k]) for k in first)
        assert any(not torch.equal(first[k], third[k]) for k in first if first[k].numel() > 1)
    assert (bagel_dir / "tokenizer.json").read_bytes() == (again / "tokenizer.json").read_bytes()
    assert build_tiny_bagel(bagel_dir, seed=0) == bagel_dir  # an identical build is kept, not rebuilt


def test_upstream_names_shapes_and_the_two_experts(bagel_dir):
    config = json.loads((bagel_dir / "config.json").read_text())
    llm = json.loads((bagel_dir / "llm_config.json").read_text())
    assert config["llm_config"] == llm and config["flowgrpo_tiny_ae"] == TINY_AE
    ema = load_file(str(bagel_dir / "ema.safetensors"))
    hidden, layers = llm["hidden_size"], llm["num_hidden_layers"]
    head_dim = hidden // llm["num_attention_heads"]
    for layer in range(layers):
        prefix = f"language_model.model.layers.{layer}."
        for expert in ("", "_moe_gen"):
            assert ema[f"{prefix}self_attn.q_proj{expert}.weight"].shape == (hidden, hidden)
            assert ema[f"{prefix}self_attn.k_proj{expert}.weight"].shape == (llm["num_key_value_heads"] * head_dim,
                                                                            hidden)
            assert ema[f"{prefix}self_attn.q_norm{expert}.weight"].shape == (head_dim,)
        mlp, gen = ema[f"{prefix}mlp.gate_proj.weight"], ema[f"{prefix}mlp_moe_gen.gate_proj.weight"]
        assert mlp.shape == gen.shape == (llm["intermediate_size"], hidden) and not torch.equal(mlp, gen)
        und_norm, gen_norm = ema[f"{prefix}input_layernorm.weight"], ema[f"{prefix}input_layernorm_moe_gen.weight"]
        assert not torch.equal(und_norm, gen_norm) and (und_norm - 1).abs().max() > 0
    token = 4 * TINY_AE["z_channels"]  # a 2x2 patch of latent channels
    assert ema["vae2llm.weight"].shape == (hidden, token) and ema["llm2vae.weight"].shape == (token, hidden)
    assert ema["latent_pos_embed.pos_embed"].shape == (config["max_latent_size"] ** 2, hidden)
    assert ema["vit_pos_embed.pos_embed"].shape == (config["vit_max_num_patch_per_side"] ** 2, hidden)
    assert any(k.startswith("vit_model.vision_model.encoder.layers.0.") for k in ema)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(bagel_dir)
    assert len(tokenizer) == llm["vocab_size"] == ema["language_model.model.embed_tokens.weight"].shape[0]
    assert tokenizer.convert_tokens_to_ids(tiny_bagel.FIM_MIDDLE) != tokenizer.unk_token_id


def test_sincos_table_rows_and_columns():
    table = tiny_bagel.sincos_2d(8, 3)  # [9, 8]: channels 0-3 encode the column, 4-7 the row
    assert table.shape == (9, 8)
    column, row = table[:, :4].reshape(3, 3, 4), table[:, 4:].reshape(3, 3, 4)
    assert torch.equal(column[0], column[2]) and not torch.equal(column[:, 0], column[:, 2])
    assert torch.equal(row[:, 0], row[:, 2]) and not torch.equal(row[0], row[2])
    assert torch.allclose(table[4, :4], torch.tensor([torch.sin(torch.tensor(1.0)), torch.sin(torch.tensor(1e-2)),
                                                      torch.cos(torch.tensor(1.0)), torch.cos(torch.tensor(1e-2))]))


def test_autoencoder_names_round_trip_through_diffusers_converter(bagel_dir):
    original = load_file(str(bagel_dir / "ae.safetensors"))
    autoencoder = load_flux_autoencoder(bagel_dir / "ae.safetensors", TINY_AE)  # strict
    back = diffusers_to_ldm_vae(autoencoder.state_dict())
    assert back.keys() == original.keys()
    assert all(torch.equal(back[k], original[k]) for k in original)


def test_vllm_omni_autoencoder_loads_it_and_decodes_as_ours(bagel_dir):
    """vllm-omni's own FLUX autoencoder (what its BAGEL pipeline runs) loads the file strictly, and its decode and
    encode (mean) equal diffusers' AutoencoderKL on the same weights."""
    from vllm_omni.diffusion.models.bagel.autoencoder import AutoEncoder, AutoEncoderParams

    theirs = AutoEncoder(AutoEncoderParams(**TINY_AE)).eval()
    theirs.load_state_dict(load_file(str(bagel_dir / "ae.safetensors")), strict=True)
    ours = load_flux_autoencoder(bagel_dir / "ae.safetensors", TINY_AE)
    generator = torch.Generator().manual_seed(3)
    latents = torch.randn(2, TINY_AE["z_channels"], 8, 8, generator=generator)
    with torch.no_grad():
        expected = theirs.decode(latents)  # un-scales the latents itself
        got = ours.decode(latents / TINY_AE["scale_factor"] + TINY_AE["shift_factor"]).sample
        assert got.shape == (2, 3, 64, 64)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        images = torch.rand(2, 3, 64, 64, generator=generator) * 2 - 1
        mean = ours.encode(images).latent_dist.mode()
        theirs_mean = theirs.encoder(images).chunk(2, dim=1)[0]
        torch.testing.assert_close(mean, theirs_mean, rtol=1e-5, atol=1e-5)


def test_real_width_builder_is_deterministic_and_loads(tmp_path):
    """The real-width preset's layout at a narrow size (seconds on a CPU): same seed, same files; bf16 tensors that
    `BagelMoT` loads strictly, the embedding padded to the vocabulary size, the ViT's input side in the preprocessor."""
    from app.models.bagel.model import BagelMoT
    from app.models.bagel.real_width import SIGLIP_SO400M, VOCAB, build_real_width_bagel, real_width_size

    real = real_width_size()
    assert (real.hidden, real.intermediate, real.heads, real.kv_heads, real.head_dim, real.layers) == (
        3584, 18944, 28, 4, 128, 4)
    assert real.vit["hidden_size"] == 1152 and real.vocab_size == VOCAB and real.max_latent_size == 64
    narrow = real_width_size(layers=1, hidden=256, intermediate=384, heads=2, kv_heads=1, vocab_size=2048,
                             vit=dict(SIGLIP_SO400M, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                                      num_hidden_layers=1), autoencoder=TINY_AE)
    first, again = (build_real_width_bagel(tmp_path / name, size=narrow, device="cpu") for name in ("a", "b"))
    ema, ema_again = (load_file(str(d / "ema.safetensors")) for d in (first, again))
    assert ema.keys() == ema_again.keys() and all(torch.equal(ema[k], ema_again[k]) for k in ema)
    assert ema["language_model.model.layers.0.mlp_moe_gen.up_proj.weight"].dtype == torch.bfloat16
    model = BagelMoT.from_checkpoint(first, dtype=torch.bfloat16)
    assert model.language_model.model.embed_tokens.weight.shape == (2048, 256) and model.head_dim == 128
    preprocessor = json.loads((first / "preprocessor_config.json").read_text())
    assert preprocessor["size"] == {"height": 518, "width": 518}
