"""Prompt order and sharding: a pure function of (seed, step), so a resumed run sees the same prompts."""

import numpy as np
import pytest

from app.config import RolloutConfig
from app.prompt_sets import BUILTIN, load_prompts
from app.train.prompts import group_request, group_seed, step_prompts

PROMPTS = [f"prompt {i}" for i in range(5)]


def test_each_pass_visits_every_prompt_once_in_a_seeded_order():
    drawn = [p for step in range(5) for _, p in step_prompts(PROMPTS, step, 2, seed=3)]  # 10 groups = 2 passes
    assert sorted(drawn[:5]) == PROMPTS and sorted(drawn[5:]) == PROMPTS
    assert drawn[:5] != drawn[5:] or drawn[:5] != PROMPTS  # shuffled (seed 3 happens not to give the identity)
    again = [p for step in range(5) for _, p in step_prompts(PROMPTS, step, 2, seed=3)]
    assert again == drawn
    other = [p for step in range(5) for _, p in step_prompts(PROMPTS, step, 2, seed=4)]
    assert other != drawn


def test_group_indices_continue_across_steps_and_file_order_without_shuffle():
    assert [g for g, _ in step_prompts(PROMPTS, 3, 4, seed=0)] == [12, 13, 14, 15]
    assert [p for _, p in step_prompts(PROMPTS, 1, 3, seed=0, shuffle=False)] == ["prompt 3", "prompt 4", "prompt 0"]


def test_group_seeds_are_distinct_and_reproducible():
    seeds = {group_seed(0, g) for g in range(1000)}
    assert len(seeds) == 1000 and group_seed(0, 7) == group_seed(0, 7) and group_seed(1, 7) != group_seed(0, 7)
    assert all(0 <= s < 2**63 for s in seeds)


def test_prompt_file_and_builtin_sets(tmp_path):
    path = tmp_path / "p.txt"
    path.write_text('# OCR prompts\n\nA sign that says "HI"\n  A mug with "RAY"  \n')
    assert load_prompts(str(path)) == ['A sign that says "HI"', 'A mug with "RAY"']
    assert load_prompts("ocr_tiny") == BUILTIN["ocr_tiny"]
    with pytest.raises(ValueError, match="data.prompts='nope'"):
        load_prompts("nope")
    (tmp_path / "empty.txt").write_text("# nothing\n")
    with pytest.raises(ValueError, match="holds no prompts"):
        load_prompts(str(tmp_path / "empty.txt"))


def test_a_group_s_request_follows_the_rollout_section_and_is_seeded_per_group():
    rollout = RolloutConfig(group_size=4, height=64, width=64, num_inference_steps=3)
    a, b = group_request(rollout, 'a sign "A"', 0, seed=7), group_request(rollout, 'a sign "A"', 1, seed=7)
    assert (a.n, a.height, a.num_inference_steps, a.noise_level) == (4, 64, 3, rollout.noise_level)
    assert a.seed == group_seed(7, 0) != b.seed and (a.group_id, b.group_id) == (0, 1) and a.negative_prompt is None
    assert group_request(rollout, 'a sign "A"', 0, seed=8).seed != a.seed
    with_cfg = RolloutConfig(group_size=4, height=64, width=64, guidance_scale=4.0)
    assert group_request(with_cfg, "x", 0, seed=7, lora_version=3).negative_prompt == with_cfg.negative_prompt
    assert group_request(with_cfg, "x", 0, seed=7, lora_version=3).lora_version == 3


def test_a_group_s_sde_window_is_placed_for_its_group_and_training_step():
    from app.config import SdeWindowConfig

    random = RolloutConfig(num_inference_steps=10, sde_window=SdeWindowConfig(size=2))
    windows = {group_request(random, "x", g, seed=7).sde_window for g in range(40)}
    assert len(windows) > 3 and all(hi - lo == 2 and 0 <= lo <= 8 for lo, hi in windows)
    assert group_request(random, "x", 5, seed=7, step=0).sde_window == group_request(random, "x", 5, seed=7,
                                                                                     step=9).sde_window
    sliding = RolloutConfig(num_inference_steps=10, sde_window=SdeWindowConfig(size=2, placement="sliding", every=3))
    assert [group_request(sliding, "x", 0, seed=7, step=s).sde_window[0] for s in (0, 2, 3, 6, 99)] == [0, 0, 1, 2, 8]
    assert group_request(RolloutConfig(), "x", 0, seed=7).sde_window is None  # no window: every step stochastic


def test_edit_prompts_from_jsonl_carry_their_image_into_the_request(tmp_path):
    import json

    import numpy as np
    from PIL import Image

    from app.prompt_sets import EditPrompt

    picture = np.zeros((32, 48, 3), dtype=np.uint8)
    picture[:, :, 0] = 200
    Image.fromarray(picture).save(tmp_path / "sign.png")
    lines = [{"prompt": 'Make the sign say "OPEN"', "image": "sign.png"}, {"prompt": 'A sign that says "HI"'}]
    (tmp_path / "edits.jsonl").write_text("\n".join(json.dumps(line) for line in lines) + "\n\n")
    edit, text = load_prompts(str(tmp_path / "edits.jsonl"))
    assert isinstance(edit, EditPrompt) and text == 'A sign that says "HI"'
    assert np.array_equal(edit.image, picture)  # an image path relative to the file, read as RGB
    request = group_request(RolloutConfig(), edit, 3, seed=0)
    assert request.prompt == 'Make the sign say "OPEN"' and request.is_edit
    assert request.image.shape == (32, 48, 3) and request.image.dtype.is_floating_point is False
    assert not group_request(RolloutConfig(), text, 4, seed=0).is_edit


@pytest.mark.parametrize("line, message", [
    ("not json", "line 1 is not JSON"),
    ('{"image": "x.png"}', 'line 1 needs a non-empty "prompt"'),
    ('{"prompt": "p", "image": "missing.png"}', "is not a readable image"),
])
def test_a_bad_jsonl_line_says_which_and_why(tmp_path, line, message):
    (tmp_path / "p.jsonl").write_text(line + "\n")
    with pytest.raises(ValueError, match=message):
        load_prompts(str(tmp_path / "p.jsonl"))


def test_builtin_edit_set_renders_its_signs_deterministically():
    first, again = load_prompts("ocr_edit_tiny"), load_prompts("ocr_edit_tiny")
    assert len(first) == 8 and all('"' in str(p) for p in first)  # the new text in quotes: the OCR reward's target
    assert all(p.image.shape == (64, 64, 3) and (p.image < 128).any() for p in first)  # dark text on white
    assert all(np.array_equal(a.image, b.image) for a, b in zip(first, again, strict=True))
    mixed = load_prompts("ocr_mixed_tiny")
    assert sum(isinstance(p, str) for p in mixed) == 8 and len(mixed) == 16
