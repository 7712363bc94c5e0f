"""The tiny Qwen-Image checkpoint: deterministic, loadable by diffusers, prompt embeddings not shifted."""

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from app.models.qwen_image.tiny import QWEN_IMAGE_TEMPLATE, QWEN_IMAGE_TEMPLATE_START_IDX, build_tiny_qwen_image


@pytest.fixture(scope="module")
def pipe(tiny_model_dir):
    from diffusers import QwenImagePipeline

    p = QwenImagePipeline.from_pretrained(tiny_model_dir, dtype=torch.float32)
    p.set_progress_bar_config(disable=True)
    return p


def test_generates_a_64x64_image_in_two_steps(pipe):
    out = pipe("a red cube", height=64, width=64, num_inference_steps=2, true_cfg_scale=1.0,
               generator=torch.Generator().manual_seed(0), output_type="np")
    image = out.images[0]
    assert image.shape == (64, 64, 3)
    assert np.isfinite(image).all() and image.std() > 0.01  # not a blank or NaN image


def test_prompt_embeddings_of_different_prompts_differ(pipe):
    a, mask_a = pipe.encode_prompt("a red cube")
    b, mask_b = pipe.encode_prompt('a sign that says "OPEN"')
    assert a.shape[1] > 0 and b.shape[1] > 0
    n = min(a.shape[1], b.shape[1])
    assert not torch.allclose(a[:, :n], b[:, :n])


def test_prompt_embeddings_start_at_the_prompt(pipe):
    """The pipeline drops the first 34 hidden states (the system prefix). With our tokenizer the prefix is exactly
    34 tokens, so the kept embeddings are the prompt's tokens followed by the template suffix: for "a red cube" →
    ["a", " red", " cube", <|im_end|>, "\\n", <|im_start|>, "assistant", "\\n"], and they equal the text encoder's
    last hidden states at exactly those positions."""
    tok = pipe.tokenizer
    prompt = "a red cube"
    assert pipe.prompt_template_encode == QWEN_IMAGE_TEMPLATE
    assert pipe.prompt_template_encode_start_idx == QWEN_IMAGE_TEMPLATE_START_IDX
    full = tok(QWEN_IMAGE_TEMPLATE.format(prompt), return_tensors="pt")
    kept = full.input_ids[0, QWEN_IMAGE_TEMPLATE_START_IDX:]
    assert tok.convert_ids_to_tokens(kept.tolist())[:4] == ["a", "Ġred", "Ġcube", "<|im_end|>"]
    embeds, mask = pipe.encode_prompt(prompt)
    assert embeds.shape[1] == len(kept)
    assert mask is None or int(mask.sum()) == len(kept)  # diffusers returns None for an all-ones mask
    with torch.no_grad():
        hidden = pipe.text_encoder(input_ids=full.input_ids, attention_mask=full.attention_mask,
                                   output_hidden_states=True).hidden_states[-1]
    assert torch.equal(embeds[0], hidden[0, QWEN_IMAGE_TEMPLATE_START_IDX:])


def test_same_seed_gives_identical_tensors_and_other_seed_differs(tmp_path, tiny_model_dir):
    again = build_tiny_qwen_image(tmp_path / "again", seed=0)
    other = build_tiny_qwen_image(tmp_path / "other", seed=1)
    for part in ("transformer", "vae", "text_encoder"):
        (ref_file,) = sorted((tiny_model_dir / part).glob("*.safetensors"))
        ref, same = load_file(ref_file), load_file(again / part / ref_file.name)
        diff = load_file(other / part / ref_file.name)
        assert ref.keys() == same.keys() and all(torch.equal(ref[k], same[k]) for k in ref)
        assert all(t.dtype == torch.float32 for t in ref.values() if t.is_floating_point())
        assert any(not torch.equal(ref[k], diff[k]) for k in ref if ref[k].numel() > 1)

    def vocab(d):
        return json.loads((d / "tokenizer" / "tokenizer.json").read_text())["model"]["vocab"]

    assert vocab(tiny_model_dir) == vocab(again)


def test_checkpoint_is_a_few_megabytes(tiny_model_dir):
    size = sum(f.stat().st_size for f in tiny_model_dir.rglob("*") if f.is_file())
    assert size < 8 * 2**20, size


def test_cli_builds_and_reuses(tmp_path, capsys):
    from jobs.make_tiny_models import main

    assert main(["--out", str(tmp_path / "m"), "--seed", "3"]) == 0
    stamp = (tmp_path / "m" / "model_index.json").stat().st_mtime_ns
    assert main(["--out", str(tmp_path / "m"), "--seed", "3"]) == 0  # identical build: kept as is
    assert (tmp_path / "m" / "model_index.json").stat().st_mtime_ns == stamp
    assert "tiny qwen_image checkpoint (seed 3)" in capsys.readouterr().out
