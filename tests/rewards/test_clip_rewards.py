"""PickScore, CLIPScore and the aesthetic score (app/rewards/clip.py) on the tiny random CLIP built here: a random
model ranks nothing meaningfully, so these check what must hold of any weights — the published formulas against
an independent float64 computation, determinism, batch invariance, fp32 against bf16, each score's range — and that
a missing folder or an unset key is said in one line naming the key."""

import numpy as np
import pytest
import torch

from app.config import ConfigError, load
from app.rewards import build_reward
from app.rewards.clip import ClipReward
from deployments.reward import reward_options

PROMPTS = ['a sign that says "OPEN"', "a red cube", "a photo of a cat", 'text reading "HELLO"', "a red cube"]


def _images(n=5, seed=0):
    return np.random.default_rng(seed).integers(0, 256, (n, 48, 40, 3), dtype=np.uint8)


def _reward(kind, folder, **kwargs):
    return ClipReward(kind, str(folder), head_path=str(folder / "aesthetic_head.pth"), **kwargs)


@pytest.mark.parametrize("kind", ["pickscore", "clipscore"])
def test_the_score_is_the_published_formula_in_float64(kind, tiny_clip_dir):
    """PickScore = exp(logit_scale) · cos / 26 (flow_grpo's normalisation); CLIPScore = 2.5 · max(cos, 0)."""
    from transformers import CLIPModel, CLIPProcessor

    images = _images()
    ours = _reward(kind, tiny_clip_dir).score(images, PROMPTS)
    model = CLIPModel.from_pretrained(tiny_clip_dir, dtype=torch.float64).eval()
    processor = CLIPProcessor.from_pretrained(tiny_clip_dir)
    with torch.no_grad():
        pixels = processor(images=list(images), return_tensors="pt")["pixel_values"].double()
        tokens = processor(text=PROMPTS, padding="max_length", truncation=True, max_length=77, return_tensors="pt")
        image = model.get_image_features(pixel_values=pixels).pooler_output
        text = model.get_text_features(**tokens).pooler_output
        cos = torch.nn.functional.cosine_similarity(image, text, dim=-1)
        exact = model.logit_scale.exp() * cos / 26 if kind == "pickscore" else 2.5 * cos.clamp(min=0)
    np.testing.assert_allclose(ours, exact.numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["pickscore", "clipscore", "aesthetic"])
def test_scores_are_deterministic_batch_invariant_in_range_and_agree_in_bf16(kind, tiny_clip_dir):
    images = _images()
    reward = _reward(kind, tiny_clip_dir, batch_size=2)
    scores = reward.score(images, PROMPTS)
    assert scores == reward.score(images, PROMPTS)  # the same bits again
    alone = [reward.score(images[i:i + 1], PROMPTS[i:i + 1])[0] for i in range(len(images))]
    np.testing.assert_allclose(scores, alone, rtol=0, atol=1e-6)  # whatever else is in its batch
    bf16 = _reward(kind, tiny_clip_dir, dtype="bfloat16").score(images, PROMPTS)
    np.testing.assert_allclose(bf16, scores, rtol=0, atol=2e-2)
    scale = float(reward.model.logit_scale.exp()) / 26
    if kind == "pickscore":
        assert all(-scale <= s <= scale for s in scores)
    elif kind == "clipscore":
        assert all(0 <= s <= 2.5 for s in scores)
    assert len(set(scores)) > 1  # images are told apart
    if kind == "aesthetic":  # the prompt is not read
        assert reward.score(images, ["x"] * len(images)) == scores
    else:  # the prompt is read: the same image under another prompt scores otherwise
        assert reward.score(images[:1], PROMPTS[1:2]) != scores[:1]


def test_the_terms_join_the_composite_from_the_config_s_sections(tiny_clip_dir):
    config = load("configs/tiny_cpu.yaml", [
        "reward.weights={pickscore: 1.0, clipscore: 0.5, aesthetic: 0.25, jpeg_compressibility: 0.1}",
        f"reward.pickscore.path={tiny_clip_dir}", f"reward.clipscore.path={tiny_clip_dir}",
        f"reward.aesthetic.path={tiny_clip_dir}", f"reward.aesthetic.head_path={tiny_clip_dir / 'aesthetic_head.pth'}"])
    reward = build_reward(config.reward.weights, reward_options(config.reward))
    result = reward.score(_images(2), PROMPTS[:2])
    assert set(result.components) == {"pickscore", "clipscore", "aesthetic", "jpeg_compressibility"}
    for i in range(2):
        c = result.components
        expected = c["pickscore"][i] + 0.5 * c["clipscore"][i] + 0.25 * c["aesthetic"][i] + 0.1 * c[
            "jpeg_compressibility"][i]
        assert result.total[i] == pytest.approx(expected)


def test_a_missing_folder_or_key_is_one_line_naming_it(tiny_clip_dir, tmp_path):
    with pytest.raises(ConfigError, match="reward.weights names pickscore: set reward.pickscore.path"):
        load("configs/tiny_cpu.yaml", ["reward.weights={pickscore: 1.0}"])
    with pytest.raises(ConfigError, match="set reward.aesthetic.head_path"):
        load("configs/tiny_cpu.yaml", ["reward.weights={aesthetic: 1.0}", f"reward.aesthetic.path={tiny_clip_dir}"])
    config = load("configs/tiny_cpu.yaml", ["reward.weights={pickscore: 1.0}", f"reward.pickscore.path={tmp_path}"])
    with pytest.raises(ValueError, match=f"^reward.pickscore.path={tmp_path}: not the folder of a transformers "
                                         "CLIPModel \\(no config.json there\\)$"):
        build_reward(config.reward.weights, reward_options(config.reward))
    with pytest.raises(ValueError, match="reward.aesthetic.head_path=.*nope.pth: no aesthetic head there"):
        ClipReward("aesthetic", str(tiny_clip_dir), head_path=str(tmp_path / "nope.pth"))


def test_the_sd35m_pickscore_recipe_is_flow_grpo_s():
    required = ["model.path=/models/sd35m", "data.prompts=ocr_tiny", "eval.prompts=ocr_eval_tiny"]
    with pytest.raises(ConfigError, match="reward.pickscore.path"):
        load("configs/sd35m_pickscore.yaml", required)
    config = load("configs/sd35m_pickscore.yaml", [*required, "reward.pickscore.path=/models/PickScore_v1"])
    assert config.reward.weights == {"pickscore": 1.0} and config.train.kl_beta == 0.01
    rollout = config.rollout
    assert (rollout.group_size, rollout.num_inference_steps, rollout.guidance_scale) == (24, 10, 4.5)
    assert (config.train.groups_per_step, config.train.clip_range, config.eval.num_inference_steps) == (24, 1e-4, 40)
