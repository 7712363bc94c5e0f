"""The VLM judge's own deployment: the `vlm_judge` term's model (app/rewards/judge.py) loads once per judge replica,
on the GPU share or CPUs the judge section gives it, and every reward replica asks it through a handle. The judge
scales apart from the CPU rewards (OCR, JPEG), and concurrent groups from several reward replicas are read in one
batched forward (`@serve.batch`, applied in builders.py)."""

from __future__ import annotations

import asyncio

import numpy as np

from app.config import JudgeRewardConfig


class JudgeScorer:
    def __init__(self, judge: JudgeRewardConfig, *, torch_threads: int | None = 1):
        import torch

        from app.rewards.judge import VlmJudgeReward

        if torch_threads:
            torch.set_num_threads(torch_threads)
        self.judge = VlmJudgeReward(judge.path, mode=judge.mode, batch_size=judge.batch_size,
                                    max_new_tokens=judge.max_new_tokens)

    def _score_many(self, batches: list[tuple]) -> list[tuple[list[float], list[str]]]:
        """Every request's images in one pass (the judge cuts it into its own batches), split back per request."""
        images = [im for request, _ in batches for im in request]  # a list: requests may differ in size
        prompts = [p for _, ps in batches for p in ps]
        scores, answers = self.judge.score_and_read(images, prompts)
        out, start = [], 0
        for im, _ in batches:
            out.append((scores[start:start + len(im)], answers[start:start + len(im)]))
            start += len(im)
        return out

    async def score_batch(self, batches: list[tuple]) -> list[tuple[list[float], list[str]]]:
        return await asyncio.to_thread(self._score_many, batches)

    async def _score_one(self, request: tuple) -> tuple[list[float], list[str]]:
        """One request's answer; the Serve deployment replaces this with a `@serve.batch`ed version."""
        return (await self.score_batch([request]))[0]

    async def score(self, images, prompts: list[str]) -> tuple[list[float], list[str]]:
        """(scores, what the judge answered) of one request; the deployment batches concurrent ones."""
        return await self._score_one((images, list(prompts)))


class RemoteJudge:
    """The `vlm_judge` term inside a reward replica: the judge deployment answers (a blocking call: the reward
    replica scores in a worker thread, never on its event loop)."""

    name = "vlm_judge"

    def __init__(self, handle):
        self.handle = handle

    def score_and_read(self, images: np.ndarray, prompts) -> tuple[list[float], list[str]]:
        return self.handle.score.remote(images, list(prompts)).result()

    def score(self, images: np.ndarray, prompts) -> list[float]:
        return self.score_and_read(images, prompts)[0]
