"""The Reward protocol and its result record."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np


class Reward(Protocol):
    name: str

    def score(self, images: np.ndarray, prompts: Sequence[str]) -> list[float]:
        """images: uint8 [n, H, W, 3]; prompts: n strings. One score per image, higher is better."""


@dataclass
class RewardScores:
    """Scores of a batch of images: the weighted total and every component (for logging and debugging)."""

    total: list[float]
    components: dict[str, list[float]] = field(default_factory=dict)
    # what a reward read from each image, where it reads something (the OCR reward: the recognised text)
    details: dict[str, list[str]] = field(default_factory=dict)
    # how long the reward replica took to score the batch (0: not measured), for sizing the reward replicas
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return {"total": self.total, "components": self.components, **({"details": self.details} if self.details
                                                                          else {})}


def as_uint8_images(images) -> np.ndarray:
    """uint8 [n, H, W, 3] from a torch tensor, numpy array or list of arrays / PIL images."""
    if hasattr(images, "numpy") and not isinstance(images, np.ndarray):
        images = images.cpu().numpy()
    if isinstance(images, (list, tuple)):
        images = np.stack([np.asarray(im.convert("RGB") if hasattr(im, "convert") else im) for im in images])
    images = np.asarray(images)
    if images.dtype != np.uint8 or images.ndim != 4 or images.shape[-1] != 3:
        raise ValueError(f"images must be uint8 [n, H, W, 3]; got {images.dtype} {list(images.shape)}")
    return images
