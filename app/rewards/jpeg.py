"""JPEG compressibility (DDPO): reward = −(size of the image as a quality-95 JPEG, in kB). Smaller files, i.e.
simpler images, score higher; a tiny random model can learn it on a CPU in a few steps."""

from __future__ import annotations

import io
from collections.abc import Sequence

import numpy as np
from PIL import Image


def jpeg_kb(image: np.ndarray, quality: int = 95) -> float:
    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format="JPEG", quality=quality)
    return buffer.tell() / 1000


class JpegCompressibilityReward:
    name = "jpeg_compressibility"

    def __init__(self, quality: int = 95):
        self.quality = quality

    def score(self, images: np.ndarray, prompts: Sequence[str]) -> list[float]:
        return [-jpeg_kb(im, self.quality) for im in images]
