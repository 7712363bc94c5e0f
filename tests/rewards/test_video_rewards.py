"""Rewards of videos: every image term scores the frames `reward.frames.every` picks and a video's score is their
mean (the OCR reward reads each frame: what it read travels per video); `temporal_consistency` sees time, against a
float64 reference; the config refuses a video term for an image family."""

import numpy as np
import pytest
from test_rewards import render

from app.config import ConfigError, load
from app.rewards import build_reward
from app.rewards.jpeg import JpegCompressibilityReward
from app.rewards.video import TemporalConsistencyReward


def video(frames: list[np.ndarray]) -> np.ndarray:
    return np.stack(frames)


@pytest.mark.parametrize("every", [1, 2, 3])
def test_an_image_term_scores_the_picked_frames_and_averages_them(every):
    rng = np.random.default_rng(0)
    videos = rng.integers(0, 256, (2, 7, 32, 32, 3), dtype=np.uint8)
    videos[0, ::2] = 128  # flat frames compress well: the frames chosen change the score
    reward = build_reward({"jpeg_compressibility": 1.0}, frames_every=every)
    result = reward.score(videos, ["a", "b"])
    jpeg = JpegCompressibilityReward()
    for i in range(2):
        picked = videos[i, ::every]
        expected = np.mean(jpeg.score(picked, ["a"] * len(picked)))
        assert result.components["jpeg_compressibility"][i] == pytest.approx(expected)
    assert len(result.total) == 2


def test_ocr_reads_each_frame_and_keeps_what_it_read_per_video():
    reward = build_reward({"ocr": 1.0})
    blank = np.full_like(render("OPEN"), 255)
    videos = np.stack([video([render("OPEN"), render("OPEN")]), video([render("OPEN"), blank])])
    result = reward.score(videos, ['"OPEN"', '"OPEN"'])
    full, half = result.components["ocr"]
    assert full >= 0.9 and half == pytest.approx(full / 2, abs=0.05)  # one frame of two reads the text
    assert len(result.details["ocr"]) == 2 and result.details["ocr"][0].upper().count("OPEN") == 2


def test_temporal_consistency_against_a_float64_reference():
    rng = np.random.default_rng(1)
    videos = rng.integers(0, 256, (3, 5, 16, 16, 3), dtype=np.uint8)
    videos[1] = videos[1, :1]  # a still video
    videos[2, 1::2] = 255 - videos[2, ::2][:2]  # flicker: every other frame inverted
    scores = TemporalConsistencyReward().score(videos, ["p"] * 3)
    v = videos.astype(np.float64)
    reference = 1 - np.abs(v[:, 1:] - v[:, :-1]).mean(axis=(1, 2, 3, 4)) / 255
    assert scores == pytest.approx(reference.tolist(), abs=1e-12)
    assert scores[1] == 1.0 and scores[2] < scores[0] < 1
    assert TemporalConsistencyReward().score(videos[:, :1], ["p"] * 3) == [1.0] * 3  # one frame: nothing moves


def test_a_composite_of_frames_and_time_weights_both():
    rng = np.random.default_rng(2)
    videos = rng.integers(0, 256, (2, 5, 16, 16, 3), dtype=np.uint8)
    result = build_reward({"jpeg_compressibility": 0.5, "temporal_consistency": 2.0}).score(videos, ["a", "b"])
    for i in range(2):
        parts = result.components
        expected = 0.5 * parts["jpeg_compressibility"][i] + 2.0 * parts["temporal_consistency"][i]
        assert result.total[i] == pytest.approx(expected)


def test_images_given_to_a_term_that_sees_time_or_videos_of_floats_are_refused():
    reward = build_reward({"temporal_consistency": 1.0})
    with pytest.raises(ValueError, match="scores videos .* these are images"):
        reward.score(np.zeros((2, 8, 8, 3), dtype=np.uint8), ["a", "b"])
    with pytest.raises(ValueError, match=r"videos must be uint8 \[n, F, H, W, 3\]"):
        reward.score(np.zeros((2, 3, 8, 8, 3), dtype=np.float32), ["a", "b"])


def test_the_config_names_a_video_term_for_an_image_family_and_a_bad_stride():
    with pytest.raises(ConfigError, match=r"names \['temporal_consistency'\]: it scores videos, and model.family="
                                          "qwen_image generates images"):
        load("configs/tiny_cpu.yaml", ["reward.weights={temporal_consistency: 1.0}"])
    with pytest.raises(ConfigError, match=r"reward.frames.every=0 must be >= 1"):
        load("configs/tiny_wan_cpu.yaml", ["reward.frames.every=0"])
    assert load("configs/tiny_wan_cpu.yaml", ["reward.frames.every=4"]).reward.frames.every == 4
