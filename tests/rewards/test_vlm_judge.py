"""The VLM judge (app/rewards/judge.py) on the tiny random Qwen2.5-VL built here: random weights read no text and
judge nothing, so these check what must hold of any judge — yesno's P(Yes) against an independent float64
computation, the reading scored exactly as the OCR term scores rapidocr's, determinism, batch invariance, fp32
against bf16 — and that a missing folder, an unset key or a bad mode is said in one line naming the key."""

import numpy as np
import pytest
import torch

from app.config import ConfigError, load
from app.rewards import build_reward
from app.rewards.judge import YESNO_QUESTION, VlmJudgeReward
from app.rewards.ocr import ocr_score, target_text
from deployments.reward import reward_options

PROMPTS = ['a sign that says "OPEN"', "a red cube", 'text reading "HELLO"', "a photo of a cat", 'the word "RAY"']


def _images(n=5, seed=0):
    return np.random.default_rng(seed).integers(0, 256, (n, 64, 48, 3), dtype=np.uint8)


def test_yesno_is_the_share_of_yes_in_float64(tiny_judge_dir):
    """P(Yes) / (P(Yes) + P(No)) of the first answer token, each image alone in float64, against the batched fp32
    judge; every score strictly inside (0, 1)."""
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor

    images = _images()
    ours = VlmJudgeReward(str(tiny_judge_dir), mode="yesno", batch_size=5).score(images, PROMPTS)
    model = AutoModelForImageTextToText.from_pretrained(tiny_judge_dir, dtype=torch.float64).eval()
    processor = AutoProcessor.from_pretrained(tiny_judge_dir)
    yes, no = (processor.tokenizer.convert_tokens_to_ids(w) for w in ("Yes", "No"))
    expected = []
    for image, prompt in zip(images, PROMPTS, strict=True):
        text = processor.apply_chat_template([{"role": "user", "content": [
            {"type": "image"}, {"type": "text", "text": YESNO_QUESTION.format(prompt)}]}], add_generation_prompt=True)
        inputs = processor(text=[text], images=[Image.fromarray(image)], return_tensors="pt")
        inputs["pixel_values"] = inputs["pixel_values"].double()
        with torch.no_grad():
            logp = torch.log_softmax(model(**inputs).logits[0, -1], dim=-1)
        expected.append(float(torch.exp(logp[yes]) / (torch.exp(logp[yes]) + torch.exp(logp[no]))))
    assert np.allclose(ours, expected, atol=1e-5, rtol=0)
    assert all(0 < s < 1 for s in ours)


@pytest.mark.parametrize("mode", ["ocr", "yesno"])
def test_the_judge_is_deterministic_and_batch_invariant(mode, tiny_judge_dir):
    """The same images score the same again, one at a time, in batches of 2 or all 5 (left padding)."""
    images = _images()
    judge = VlmJudgeReward(str(tiny_judge_dir), mode=mode, batch_size=5, max_new_tokens=8)
    scores, answers = judge.score_and_read(images, PROMPTS)
    assert judge.score_and_read(images, PROMPTS) == (scores, answers)
    for size in (1, 2):
        judge.batch_size = size
        again, read = judge.score_and_read(images, PROMPTS)
        assert read == answers and np.allclose(again, scores, atol=1e-6, rtol=0)


def test_ocr_mode_scores_its_reading_as_the_ocr_term(tiny_judge_dir):
    """Greedy reading of each image, scored by the OCR term's own function against the prompt's quoted text."""
    images = _images()
    scores, read = VlmJudgeReward(str(tiny_judge_dir), mode="ocr", max_new_tokens=8).score_and_read(images, PROMPTS)
    assert len(read) == 5 and all(isinstance(t, str) for t in read)
    assert scores == [ocr_score(t, target_text(p)) for t, p in zip(read, PROMPTS, strict=True)]


def test_bf16_agrees_with_fp32(tiny_judge_dir):
    images = _images()
    fp32 = VlmJudgeReward(str(tiny_judge_dir), mode="yesno").score(images, PROMPTS)
    bf16 = VlmJudgeReward(str(tiny_judge_dir), mode="yesno", dtype="bfloat16").score(images, PROMPTS)
    assert np.allclose(bf16, fp32, atol=0.02, rtol=0)


def test_the_composite_reads_the_judge_from_the_config(tiny_judge_dir):
    """reward.vlm_judge.* reach the term through the replica's options; what the judge read is kept as details."""
    config = load("configs/tiny_cpu.yaml", [f"reward.vlm_judge.path={tiny_judge_dir}", "reward.vlm_judge.mode=yesno",
                                            "reward.weights={vlm_judge: 2.0}"])
    reward = build_reward(config.reward.weights, reward_options(config.reward))
    out = reward.score(_images(), PROMPTS)
    alone = VlmJudgeReward(str(tiny_judge_dir), mode="yesno").score(_images(), PROMPTS)
    assert np.allclose(out.total, [2 * s for s in alone], atol=1e-6, rtol=0)
    assert out.details["vlm_judge"] == ["Yes" if s >= 0.5 else "No" for s in alone]


def test_bad_judge_settings_are_one_line_naming_the_key(tmp_path, tiny_judge_dir):
    with pytest.raises(ConfigError, match=r"reward.vlm_judge.path"):
        load("configs/tiny_cpu.yaml", ["reward.weights={vlm_judge: 1.0}"])
    with pytest.raises(ConfigError, match=r"reward.vlm_judge.mode='maybe' must be ocr or yesno"):
        load("configs/tiny_cpu.yaml", [f"reward.vlm_judge.path={tiny_judge_dir}", "reward.vlm_judge.mode=maybe",
                                       "reward.weights={vlm_judge: 1.0}"])
    with pytest.raises(ValueError, match=r"^reward.vlm_judge.path=.*: not the folder of a transformers model") as err:
        VlmJudgeReward(str(tmp_path / "nowhere"))
    assert "\n" not in str(err.value)


def test_yesno_needs_single_token_answers():
    """A vocabulary that splits "Yes" (the tiny builds' tokenizer before the judge adds the two words) is refused
    in one line naming the mode, rather than scored from the first piece of the word."""
    from app.models.builds import train_tokenizer
    from app.rewards.judge import _answer_token

    with pytest.raises(ValueError, match=r"^reward.vlm_judge.mode=yesno: the judge's tokenizer splits 'Yes' into 3"):
        _answer_token(train_tokenizer(), "Yes", "reward.vlm_judge.mode=yesno")


def test_the_qwen_image_judge_recipe_loads():
    required = ["model.path=/models/qwen-image", "data.prompts=ocr_tiny"]
    with pytest.raises(ConfigError, match="reward.vlm_judge.path"):
        load("configs/qwen_image_ocr_vlm.yaml", required)
    config = load("configs/qwen_image_ocr_vlm.yaml", [*required, "reward.vlm_judge.path=/models/qwen2.5-vl-3b"])
    assert config.reward.weights == {"vlm_judge": 1.0} and config.reward.vlm_judge.mode == "ocr"
    assert config.rollout.num_replicas + config.cluster.num_workers + \
        config.reward.num_replicas * config.reward.replica_num_gpus == 8  # one 8-GPU node


def test_the_judge_deployment_reserves_its_own_resources(tiny_judge_dir):
    """Named in reward.weights, the judge is a part of its own in what the run reserves (its replicas' CPUs or GPU
    share), which the job checks against the cluster before it starts anything; not named, it reserves nothing."""
    named = load("configs/tiny_cpu.yaml", [f"reward.vlm_judge.path={tiny_judge_dir}", "reward.weights={vlm_judge: 1}",
                                           "reward.vlm_judge.num_replicas=2", "reward.vlm_judge.replica_num_gpus=0.25"])
    assert named.resources()["judge (2 x reward.vlm_judge.replica_num_cpus/gpus)"] == {"CPU": 2.0, "GPU": 0.5}
    assert not any(part.startswith("judge") for part in load("configs/tiny_cpu.yaml").resources())
