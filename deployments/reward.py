"""The reward replica: the weighted composite of app/rewards, scoring groups as they arrive. Concurrent requests
are gathered into one call with `@serve.batch` (applied in builders.py through `batched`)."""

from __future__ import annotations

import asyncio
import logging
import time

from app.config import RewardConfig
from app.rewards import RewardScores, build_reward


def ocr_options(reward: RewardConfig) -> dict:
    """The OCR reward's settings: one engine per CPU the replica holds (Ray reserves them; one engine uses one)."""
    return {"detect_min_side": reward.ocr_detect_min_side, "threads": max(1, int(reward.replica_num_cpus))}


def reward_options(reward: RewardConfig, *, ocr_threads: int | None = None, judge=None) -> dict[str, dict]:
    """Every term's constructor settings (`app.rewards.build_reward`): the OCR engines, and the model-based terms'
    folders (each error names its key); `judge`: the judge deployment's handle, asked instead of loading it here."""
    from app.rewards.composite import MODEL_REWARDS

    options = {"ocr": ocr_options(reward)}
    if ocr_threads is not None:
        options["ocr"]["threads"] = ocr_threads
    for name in MODEL_REWARDS:
        section = getattr(reward, name)
        options[name] = {"path": section.path, "processor_path": section.processor_path,
                         "head_path": section.head_path, "batch_size": section.batch_size, "key": f"reward.{name}"}
    section = reward.vlm_judge
    if judge is not None:
        from deployments.judge import RemoteJudge

        options["vlm_judge"] = {"remote": RemoteJudge(judge)}
    else:
        options["vlm_judge"] = {"path": section.path, "mode": section.mode, "batch_size": section.batch_size,
                                "max_new_tokens": section.max_new_tokens}
    return options


class RewardScorer:
    def __init__(self, reward: RewardConfig, *, torch_threads: int | None = 1, log_level: str = "INFO",
                 judge=None):
        if torch_threads:
            import torch

            torch.set_num_threads(torch_threads)
        self.reward = build_reward(reward.weights, reward_options(reward, judge=judge),
                                   frames_every=reward.frames.every)
        logging.getLogger("RapidOCR").setLevel(log_level)  # its own handler, INFO by default
        self.devices = {name: str(term.device) for name, (term, _) in self.reward.rewards.items()
                        if getattr(term, "device", None) is not None}
        logging.getLogger(__name__).info("reward terms on: %s", self.devices or "the CPUs")
        self.scored = 0

    def _score_many(self, batches: list[tuple]) -> list[RewardScores]:
        out = []
        for images, prompts in batches:
            started = time.perf_counter()
            try:
                scores = self.reward.score(images, prompts)
            except ValueError as err:  # one bad group must not fail the others batched with it
                out.append(err)
                continue
            scores.seconds = time.perf_counter() - started
            out.append(scores)
        self.scored += len(batches)
        return out

    async def score_batch(self, batches: list[tuple]) -> list[RewardScores | ValueError]:
        return await asyncio.to_thread(self._score_many, batches)

    async def _score_one(self, batch: tuple) -> RewardScores | ValueError:
        """One group's scores; the Serve deployment replaces this with a `@serve.batch`ed version."""
        return (await self.score_batch([batch]))[0]

    async def score(self, images, prompts: list[str]) -> RewardScores:
        result = await self._score_one((images, prompts))
        if isinstance(result, Exception):
            raise result
        return result

    async def info(self) -> dict:
        return {"weights": self.reward.weights, "scored": self.scored, "devices": self.devices}
