"""A weighted sum of named rewards, keeping every component."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from app.rewards.base import Reward, RewardScores
from app.rewards.video import as_uint8_media, sampled_frames


def _registry() -> dict:
    from functools import partial

    from app.rewards.clip import ClipReward
    from app.rewards.jpeg import JpegCompressibilityReward
    from app.rewards.ocr import OcrReward
    from app.rewards.video import TemporalConsistencyReward

    return {"ocr": OcrReward, "jpeg_compressibility": JpegCompressibilityReward,
            **{name: partial(ClipReward, name) for name in MODEL_REWARDS}, "vlm_judge": _judge,
            "temporal_consistency": TemporalConsistencyReward}


def _judge(remote=None, **kwargs):
    """The judge in this process, or (`remote=`: a term object, e.g. `deployments.judge.RemoteJudge`) the judge
    deployment that a reward replica asks."""
    from app.rewards.judge import VlmJudgeReward

    return remote if remote is not None else VlmJudgeReward(**kwargs)


# the model-based terms (app/rewards/clip.py) and the weights each reads from its folder
MODEL_REWARDS = {"pickscore": "PickScore_v1", "clipscore": "openai/clip-vit-large-patch14",
                 "aesthetic": "openai/clip-vit-large-patch14 and the LAION aesthetic head"}
REWARD_NAMES = ("ocr", "jpeg_compressibility", *MODEL_REWARDS, "vlm_judge",  # vlm_judge: app/rewards/judge.py
                "temporal_consistency")  # app/rewards/video.py
VIDEO_REWARDS = ("temporal_consistency",)  # terms that score whole videos (the others score images, or frames)


class WeightedReward:
    """The weighted sum. Videos [n, F, H, W, 3]: the image terms score every `frames_every`-th frame and average
    them per video; the terms that see time score the whole videos (app/rewards/video.py)."""

    def __init__(self, rewards: dict[str, tuple[Reward, float]], *, frames_every: int = 1):
        self.rewards = rewards
        self.frames_every = frames_every

    @property
    def weights(self) -> dict[str, float]:
        return {name: w for name, (_, w) in self.rewards.items()}

    def score(self, images, prompts: Sequence[str]) -> RewardScores:
        media = as_uint8_media(images)
        if len(prompts) != len(media):
            raise ValueError(f"{len(media)} images but {len(prompts)} prompts: give one prompt per image")
        frames, frame_prompts, per = media, prompts, 1
        if media.ndim == 5:  # videos: the image terms' frames, cut out once for all of them
            picked = sampled_frames(media, self.frames_every)
            per = picked.shape[1]
            frames = picked.reshape(-1, *picked.shape[2:])
            frame_prompts = [p for p in prompts for _ in range(per)]
        components, details = {}, {}
        for name, (reward, _) in self.rewards.items():
            if getattr(reward, "sees_time", False):
                scores = reward.score(media, prompts)
            elif hasattr(reward, "score_and_read"):  # a reward that reads something: keep what it read
                scores, read = reward.score_and_read(frames, frame_prompts)
                details[name] = [" | ".join(read[i:i + per]) for i in range(0, len(read), per)]
            else:
                scores = reward.score(frames, frame_prompts)
            if not getattr(reward, "sees_time", False) and per > 1:  # a video's score: its frames' mean
                scores = np.asarray(scores, dtype=np.float64).reshape(-1, per).mean(axis=1)
            components[name] = [float(s) for s in scores]
        total = [sum(w * components[name][i] for name, (_, w) in self.rewards.items()) for i in range(len(media))]
        return RewardScores(total=total, components=components, details=details)


def build_reward(weights: dict[str, float], options: dict[str, dict] | None = None, *,
                 frames_every: int = 1) -> WeightedReward:
    """The composite for `reward.weights` of the config, e.g. {"ocr": 1.0, "jpeg_compressibility": 0.1};
    `options` holds constructor arguments per reward name, e.g. {"ocr": {"detect_min_side": 64}}."""
    registry, options = _registry(), options or {}
    unknown = sorted(set(weights) - set(registry))
    if unknown or not weights:
        raise ValueError(f"unknown reward names {unknown} (known: {sorted(registry)})" if unknown
                         else "no reward named: give at least one, e.g. {'ocr': 1.0}")
    return WeightedReward({name: (registry[name](**options.get(name, {})), float(w)) for name, w in weights.items()},
                          frames_every=frames_every)
