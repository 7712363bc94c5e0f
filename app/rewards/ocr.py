"""OCR reward: how well the text in double quotes of the prompt is rendered in the image.

As in flow_grpo's OCR reward (written from its description): target = the prompt's text inside double quotes;
both target and recognised text are normalised (spaces dropped, lower case);
reward = 1 − min(Levenshtein(recognised, target), len(target)) / len(target), and 1.0 when the target appears
in the recognised text. A prompt without quoted text scores 0. OCR: rapidocr's PP-OCR models, shipped inside
its wheel (no download), run by onnxruntime on CPUs or, in a process with a GPU, by torch on it
(app/rewards/ocr_torch.py); edit distance: rapidfuzz.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from rapidfuzz.distance import Levenshtein

_QUOTED = re.compile(r'"([^"]*)"')


def target_text(prompt: str) -> str:
    """The first double-quoted part of the prompt ('' when there is none)."""
    match = _QUOTED.search(prompt)
    return match.group(1) if match else ""


def _normalise(text: str) -> str:
    return "".join(text.split()).lower()


def ocr_score(recognised: str, target: str) -> float:
    recognised, target = _normalise(recognised), _normalise(target)
    if not target:
        return 0.0
    if target in recognised:
        return 1.0
    return 1.0 - min(Levenshtein.distance(recognised, target), len(target)) / len(target)


def _default_device() -> str:
    """The GPU when this process has one (a reward replica given a GPU share), else the CPUs."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


# RapidOCR's own default: an image whose shorter side is below it is enlarged to it before text detection
DETECT_MIN_SIDE = 736


class OcrReward:
    name = "ocr"

    def __init__(self, threads: int = 1, detect_min_side: int = DETECT_MIN_SIDE, device: str | None = None):
        """`threads`: images read at once, each by its own single-threaded engine (a replica's CPUs: one
        engine's intra-op threads scale poorly on these small networks, separate engines nearly linearly).
        `detect_min_side`: the detector enlarges smaller images to this shorter side. A 64 px image enlarged to
        736 costs 0.29 s of CPU instead of 0.004 s and reads the same text here: lower it for small images.
        `device`: where the networks run: "cpu" (onnxruntime), "cuda" (torch, one copy shared by the engines,
        whose threads then only resize, search boxes and decode), None: the GPU when this process has one."""
        from rapidocr import RapidOCR

        if detect_min_side < 32:
            raise ValueError(f"detect_min_side={detect_min_side}: the text detector needs at least 32 px")
        if threads < 1:
            raise ValueError(f"threads={threads}: at least one engine reads the images")
        params = {"EngineConfig.onnxruntime.intra_op_num_threads": 1,
                  "EngineConfig.onnxruntime.inter_op_num_threads": 1, "Det.limit_side_len": detect_min_side}
        self.device = device or _default_device()
        if self.device not in ("cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device={device!r}: the OCR networks run on 'cpu' or 'cuda'")
        self._engines = [RapidOCR(params=params) for _ in range(threads)]
        if self.device != "cpu":  # the GPU: rapidocr's own networks on torch, shared by every engine
            from app.rewards.ocr_torch import torch_networks, use_torch

            networks = torch_networks(self._engines[0], self.device)
            for engine in self._engines:
                use_torch(engine, networks, self.device)
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="ocr") if threads > 1 else None

    @staticmethod
    def _read_with(engine, image: np.ndarray) -> str:
        result = engine(image)
        return " ".join(result.txts or ()) if result is not None else ""

    def read(self, image: np.ndarray) -> str:
        return self._read_with(self._engines[0], image)

    def read_all(self, images: Sequence[np.ndarray]) -> list[str]:
        """The text in each image, in order. Engine k reads images k, k+n, ... so that no engine runs in two
        threads at once (onnxruntime releases the GIL while it runs)."""
        n = len(self._engines)
        if self._pool is None or len(images) < 2:
            return [self.read(im) for im in images]
        shares = self._pool.map(lambda k: [self._read_with(self._engines[k], im) for im in images[k::n]], range(n))
        texts: list[str] = [""] * len(images)
        for k, share in enumerate(shares):
            texts[k::n] = share
        return texts

    def score(self, images: np.ndarray, prompts: Sequence[str]) -> list[float]:
        return self.score_and_read(images, prompts)[0]

    def score_and_read(self, images: np.ndarray, prompts: Sequence[str]) -> tuple[list[float], list[str]]:
        """(scores, the text recognised in each image)."""
        texts = self.read_all(images)
        return [ocr_score(t, target_text(p)) for t, p in zip(texts, prompts, strict=True)], texts


def exact_match(recognised: str, target: str) -> bool:
    """The recognised text is the target and nothing else (normalised as the reward normalises both); stricter
    than a reward of 1, which a target found inside longer text also gets."""
    return bool(_normalise(target)) and _normalise(recognised) == _normalise(target)
