"""A weighted sum of named rewards, keeping every component."""

from __future__ import annotations

from collections.abc import Sequence

from app.rewards.base import Reward, RewardScores, as_uint8_images


def _registry() -> dict:
    from functools import partial

    from app.rewards.clip import ClipReward
    from app.rewards.jpeg import JpegCompressibilityReward
    from app.rewards.ocr import OcrReward

    return {"ocr": OcrReward, "jpeg_compressibility": JpegCompressibilityReward,
            **{name: partial(ClipReward, name) for name in MODEL_REWARDS}, "vlm_judge": _judge}


def _judge(remote=None, **kwargs):
    """The judge in this process, or (`remote=`: a term object, e.g. `deployments.judge.RemoteJudge`) the judge
    deployment that a reward replica asks."""
    from app.rewards.judge import VlmJudgeReward

    return remote if remote is not None else VlmJudgeReward(**kwargs)


# the model-based terms (app/rewards/clip.py) and the weights each reads from its folder
MODEL_REWARDS = {"pickscore": "PickScore_v1", "clipscore": "openai/clip-vit-large-patch14",
                 "aesthetic": "openai/clip-vit-large-patch14 and the LAION aesthetic head"}
REWARD_NAMES = ("ocr", "jpeg_compressibility", *MODEL_REWARDS, "vlm_judge")  # vlm_judge: app/rewards/judge.py


class WeightedReward:
    def __init__(self, rewards: dict[str, tuple[Reward, float]]):
        self.rewards = rewards

    @property
    def weights(self) -> dict[str, float]:
        return {name: w for name, (_, w) in self.rewards.items()}

    def score(self, images, prompts: Sequence[str]) -> RewardScores:
        images = as_uint8_images(images)
        if len(prompts) != len(images):
            raise ValueError(f"{len(images)} images but {len(prompts)} prompts: give one prompt per image")
        components, details = {}, {}
        for name, (reward, _) in self.rewards.items():
            if hasattr(reward, "score_and_read"):  # a reward that reads something: keep what it read
                scores, details[name] = reward.score_and_read(images, prompts)
            else:
                scores = reward.score(images, prompts)
            components[name] = [float(s) for s in scores]
        total = [sum(w * components[name][i] for name, (_, w) in self.rewards.items()) for i in range(len(images))]
        return RewardScores(total=total, components=components, details=details)


def build_reward(weights: dict[str, float], options: dict[str, dict] | None = None) -> WeightedReward:
    """The composite for `reward.weights` of the config, e.g. {"ocr": 1.0, "jpeg_compressibility": 0.1};
    `options` holds constructor arguments per reward name, e.g. {"ocr": {"detect_min_side": 64}}."""
    registry, options = _registry(), options or {}
    unknown = sorted(set(weights) - set(registry))
    if unknown or not weights:
        raise ValueError(f"unknown reward names {unknown} (known: {sorted(registry)})" if unknown
                         else "no reward named: give at least one, e.g. {'ocr': 1.0}")
    return WeightedReward({name: (registry[name](**options.get(name, {})), float(w)) for name, w in weights.items()})
