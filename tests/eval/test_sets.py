"""The built-in eval sets: big enough, deterministic, held out from every training set."""

import numpy as np
import pytest

from app.config import ConfigError, load
from app.prompt_sets import BUILTIN, BUILTIN_EDITS, EVAL_SETS, eval_prompts, load_prompts, overlap
from app.rewards.ocr import target_text


def training_sets() -> list:
    return [p for name in BUILTIN for p in load_prompts(name)] + [p for name in BUILTIN_EDITS
                                                                  for p in load_prompts(name)]


def test_ocr_eval_has_512_distinct_targets_none_of_them_trained_on():
    prompts = load_prompts("ocr_eval")
    targets = [target_text(p) for p in prompts]
    assert len(prompts) >= 500 and len(set(prompts)) == len(prompts) and len(set(targets)) == len(targets)
    assert all(targets)  # every prompt has a quoted target text
    trained = {target_text(str(p)) for p in training_sets()}
    assert not trained & set(targets)
    assert overlap(prompts, training_sets()) == 0
    assert load_prompts("ocr_eval_tiny") == prompts[:4] and load_prompts("ocr_eval") == prompts


def test_edit_eval_sets_are_rendered_signs_asking_for_another_text():
    edits, again = load_prompts("ocr_edit_eval"), load_prompts("ocr_edit_eval")
    assert len(edits) == 64 and [str(e) for e in edits] == [str(e) for e in again]
    assert all(np.array_equal(a.image, b.image) for a, b in zip(edits, again, strict=True))
    assert all(e.image.dtype == np.uint8 and e.image.shape == (64, 64, 3) and e.image.min() < 128 for e in edits)
    assert [str(e) for e in load_prompts("ocr_edit_eval_tiny")] == [str(e) for e in edits[:2]]
    assert overlap(edits, training_sets()) == 0
    assert set(EVAL_SETS) == {"ocr_eval", "ocr_eval_tiny", "ocr_edit_eval", "ocr_edit_eval_tiny"}


def test_overlap_counts_training_prompts_in_a_user_eval_file(tmp_path):
    path = tmp_path / "eval.txt"
    path.write_text('A neon sign that says "BAR"\nA sign that says "NEW"\nA coffee cup printed with "LATTE"\n')
    config = load("configs/tiny_cpu.yaml", [f"eval.prompts={path}", "eval.max_prompts=2"])
    assert [str(p) for p in eval_prompts(config)] == ['A neon sign that says "BAR"', 'A sign that says "NEW"']
    assert overlap(load_prompts(str(path)), load_prompts("ocr_tiny")) == 2


@pytest.mark.parametrize("override, fragment", [
    ("eval.every=-1", "eval.every=-1"),
    ("eval.images_per_prompt=0", "eval.images_per_prompt=0"),
    ("eval.height=4096", "serve.max_side"),
    ("eval.noise_level=-0.5", "eval.noise_level=-0.5"),
    ("eval.sentinel_bands.colour_entropy_change=[0.3,-0.3]", "lo <= hi"),
    ("eval.sentinel_bands.sharpness=[0,1]", "no such sentinel"),
])
def test_bad_eval_settings_name_the_key(override, fragment):
    with pytest.raises(ConfigError, match=fragment.replace("[", r"\[").replace(".", r"\.")):
        load("configs/tiny_cpu.yaml", [override])
