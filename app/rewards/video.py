"""Rewards of videos: which frames the image terms see, and the terms that see time.

A video family's group arrives at the reward as uint8 frames [n, F, H, W, 3]. Every image term (OCR, JPEG, the
model-based ones) scores every `every`-th frame (`reward.frames.every`: 1 scores them all) and a video's score is
the mean over its scored frames; the frames are cut out once and shared by every term. A term with `sees_time`
scores whole videos instead: `temporal_consistency` below, which needs no model.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def as_uint8_media(images) -> np.ndarray:
    """uint8 images [n, H, W, 3] or videos [n, F, H, W, 3] from a torch tensor or numpy array (no copy of a
    contiguous numpy array); anything else goes through `as_uint8_images`."""
    from app.rewards.base import as_uint8_images

    if hasattr(images, "numpy") and not isinstance(images, np.ndarray):
        images = images.cpu().numpy()
    if isinstance(images, np.ndarray) and images.ndim == 5:
        if images.dtype != np.uint8 or images.shape[-1] != 3:
            raise ValueError(f"videos must be uint8 [n, F, H, W, 3]; got {images.dtype} {list(images.shape)}")
        return images
    return as_uint8_images(images)


def sampled_frames(videos: np.ndarray, every: int) -> np.ndarray:
    """The frames the image terms score, [n, k, H, W, 3]: frames 0, every, 2·every, ... of each video."""
    return videos[:, ::every]


class TemporalConsistencyReward:
    """1 − the mean absolute change between consecutive frames, over all pixels and pairs (in [0, 1]; 1: a still
    video). What flicker and jumps cost; a video that moves smoothly keeps most of it. Needs no model, sees time."""

    name = "temporal_consistency"
    sees_time = True

    def score(self, videos: np.ndarray, prompts: Sequence[str]) -> list[float]:
        if videos.ndim != 5:
            raise ValueError("temporal_consistency scores videos [n, F, H, W, 3]; these are images: use it with a "
                             "video family (model.family: wan)")
        if videos.shape[1] < 2:
            return [1.0] * len(videos)
        # one video at a time, in int16: a group of 81-frame 480p videos would need GBs as float
        return [1.0 - float(np.abs(np.diff(v.astype(np.int16), axis=0)).mean()) / 255.0 for v in videos]
