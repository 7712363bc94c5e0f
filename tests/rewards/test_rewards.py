"""Rewards on real images: rapidocr reads PIL-rendered text; JPEG size; the weighted composite."""

import numpy as np
import pytest
from PIL import Image, ImageDraw, ImageFont

from app.rewards import build_reward
from app.rewards.jpeg import JpegCompressibilityReward, jpeg_kb
from app.rewards.ocr import OcrReward, ocr_score, target_text


def render(text: str, size=(256, 96), font_size: int = 40) -> np.ndarray:
    image = Image.new("RGB", size, "white")
    ImageDraw.Draw(image).text((10, 20), text, fill="black", font=ImageFont.load_default(size=font_size))
    return np.asarray(image)


def noise(size=(96, 256)) -> np.ndarray:
    return np.random.default_rng(0).integers(0, 256, (*size, 3), dtype=np.uint8)


@pytest.fixture(scope="module")
def ocr():
    return OcrReward()


def test_ocr_scores_matching_text_high_other_text_lower_noise_zero(ocr):
    prompt = 'a shop sign that says "OPEN 24H"'
    scores = ocr.score(np.stack([render("OPEN 24H"), render("OPEN 12"), render("CLOSED"), noise()]), [prompt] * 4)
    assert scores[0] >= 0.9
    assert scores[2] < scores[1] < scores[0]
    assert scores[3] == 0.0


def test_a_smaller_detector_side_reads_the_same_text_from_small_images(ocr):
    """The tiny config's `reward.ocr_detect_min_side: 64`: its 64 px images are not enlarged to RapidOCR's 736
    before detection, and text the default setting reads is still read."""
    small = OcrReward(detect_min_side=64)
    images = [render("OPEN", size=(64, 64), font_size=16), render("OPEN 24H"), noise((64, 64))]
    assert [small.read(im) for im in images] == [ocr.read(im) for im in images] == ["OPEN", "OPEN 24H", ""]
    with pytest.raises(ValueError, match="at least 32"):
        OcrReward(detect_min_side=16)


def test_engines_in_parallel_read_what_one_engine_reads_in_order(ocr):
    """A replica of 3 CPUs reads with 3 engines at once: the texts and scores of a batch (more images than engines,
    not a multiple of them) are the one engine's, image for image; the replica gives the reward its CPUs."""
    words = ["OPEN", "RAY", "HELLO", "EXIT"]
    images = np.stack([render(w) for w in words[:3]] + [noise()])
    prompts = [f'a sign that says "{w}"' for w in words]
    scores, texts = OcrReward(threads=3).score_and_read(images, prompts)
    assert (scores, texts) == ocr.score_and_read(images, prompts)
    assert texts[:2] == ["OPEN", "RAY"] and texts[3] == ""
    with pytest.raises(ValueError, match="at least one engine"):
        OcrReward(threads=0)
    from app.config import RewardConfig
    from deployments.reward import ocr_options

    assert ocr_options(RewardConfig(replica_num_cpus=4))["threads"] == 4
    assert ocr_options(RewardConfig(replica_num_cpus=0.25))["threads"] == 1  # the tiny configs: one engine


def test_ocr_score_by_hand():
    """target "OPEN 24H" → "open24h" (7 chars). "OPEN 2H" → "open2h": distance 1 → 1 − 1/7 = 0.857143;
    contained ("we are open 24h") → 1; nothing read → 1 − 7/7 = 0; no quotes in the prompt → 0."""
    assert target_text('a sign "OPEN 24H" at night') == "OPEN 24H"
    assert ocr_score("OPEN 2H", "OPEN 24H") == pytest.approx(1 - 1 / 7)
    assert ocr_score("we are open 24h", "OPEN 24H") == 1.0
    assert ocr_score("", "OPEN 24H") == 0.0
    assert ocr_score("anything", target_text("no quotes here")) == 0.0


def test_jpeg_compressibility_prefers_flat_images():
    flat = np.full((64, 64, 3), 128, dtype=np.uint8)
    scores = JpegCompressibilityReward().score(np.stack([flat, noise((64, 64))]), ["", ""])
    assert scores[0] == pytest.approx(-jpeg_kb(flat)) and scores[0] > scores[1]


def test_composite_keeps_components_and_weights_them():
    reward = build_reward({"ocr": 1.0, "jpeg_compressibility": 0.5})
    images = np.stack([render("HELLO"), render("WORLD")])
    result = reward.score(images, ['"HELLO"', '"HELLO"'])
    for i in range(2):
        expected = result.components["ocr"][i] + 0.5 * result.components["jpeg_compressibility"][i]
        assert result.total[i] == pytest.approx(expected)
    assert result.components["ocr"][0] > result.components["ocr"][1]


def test_composite_rejects_bad_input():
    with pytest.raises(ValueError, match="unknown reward"):
        build_reward({"hpsv2": 1.0})
    reward = build_reward({"jpeg_compressibility": 1.0})
    with pytest.raises(ValueError, match="one prompt per image"):
        reward.score(np.zeros((2, 8, 8, 3), dtype=np.uint8), ["a"])
    with pytest.raises(ValueError, match="uint8"):
        reward.score(np.zeros((2, 8, 8), dtype=np.float32), ["a", "b"])


def test_a_reward_replica_says_how_long_it_scored():
    """The replica's own scoring seconds travel with the scores (`perf/reward_busy_s`, `jobs.plan`'s reward replica
    count); a bad group among good ones still fails alone."""
    import asyncio

    from app.config import RewardConfig
    from deployments.reward import RewardScorer

    scorer = RewardScorer(RewardConfig(weights={"jpeg_compressibility": 1.0}))
    good = (np.zeros((2, 64, 64, 3), dtype=np.uint8), ["a", "b"])
    scored, failed = asyncio.run(scorer.score_batch([good, (good[0], ["a"])]))
    assert scored.seconds > 0 and len(scored.total) == 2
    assert isinstance(failed, ValueError) and "one prompt per image" in str(failed)
