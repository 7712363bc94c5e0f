"""One evaluation: every prompt of the eval set through the Serve application (rollout, then reward), pinned to the
adapter version evaluated, and what it measured.

Requests are deterministic by default (`eval.noise_level: 0`) and seeded per prompt from `eval.seed` alone, so
every evaluation of a run, and `jobs.evaluate` of a saved adapter, samples the same noise: two evaluations differ
only by the adapter. Nothing here touches a training group or a random stream of the trainer: the seeds are derived,
not drawn. Ray-free: it talks to the deployments through a `RolloutClient` (groups retried as training's are).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from app.config import RunConfig, eval_request
from app.prompt_sets import Prompt
from app.rewards import RewardScores
from app.rewards.ocr import exact_match, target_text
from app.rollout.client import RolloutClient
from app.rollout.seeding import derived_seed

_EVAL_KEY = 0xE7A1  # keeps eval seeds apart from the training groups' (app.train.prompts.group_seed)


def prompt_seed(seed: int, index: int) -> int:
    """The seed of eval prompt `index` (the same in every evaluation with `eval.seed = seed`)."""
    return derived_seed(seed, index, _EVAL_KEY)


def eval_requests(config: RunConfig, prompts: list[Prompt], version: int):
    return [eval_request(config, p, prompt_seed(config.eval.seed, k), version) for k, p in enumerate(prompts)]


@dataclass
class Evaluation:
    """The images and rewards of one evaluation of adapter `version` (0: the base model)."""

    version: int
    prompts: list[str]
    seeds: list[int]
    images: np.ndarray  # uint8 [P, k, H, W, 3]: k = eval.images_per_prompt ([P, k, F, H, W, 3]: videos)
    rewards: list[RewardScores]  # one per prompt
    seconds: float  # wall time of the whole evaluation
    retries: int  # failed attempts (generation or reward) retried

    def records(self) -> list[dict]:
        """One per image: prompt, seed, target text, total reward and every term, what the OCR read."""
        out = []
        for k, (prompt, seed, scores) in enumerate(zip(self.prompts, self.seeds, self.rewards, strict=True)):
            for j, total in enumerate(scores.total):
                record = {"prompt_index": k, "image_index": j, "prompt": prompt, "seed": seed,
                          "adapter_version": self.version, "reward": total,
                          **{name: values[j] for name, values in scores.components.items()}}
                if "ocr" in scores.details:
                    target, read = target_text(prompt), scores.details["ocr"][j]
                    record.update(target=target, ocr_text=read, exact_match=exact_match(read, target))
                out.append(record)
        return out

    def metrics(self) -> dict[str, float]:
        """eval/ metrics: the total reward's mean and std, each term's mean, and with the OCR reward its accuracy
        (the mean OCR reward: 1 − normalised edit distance) and the exact-match rate."""
        records = self.records()
        total = np.array([r["reward"] for r in records])
        out = {"eval/reward/mean": float(total.mean()), "eval/reward/std": float(total.std())}
        for name in self.rewards[0].components:
            out[f"eval/reward/{name}"] = float(np.mean([r[name] for r in records]))
        if "ocr_text" in records[0]:
            out["eval/ocr_accuracy"] = float(np.mean([r["ocr"] for r in records]))
            out["eval/ocr_exact_match"] = float(np.mean([r["exact_match"] for r in records]))
        out.update({"eval/images": float(len(records)), "eval/seconds": self.seconds,
                    "eval/retries": float(self.retries)})
        return out

    def flat_images(self) -> np.ndarray:
        """uint8 [P·k, H, W, 3], prompt-major."""
        return self.images.reshape(-1, *self.images.shape[2:])


async def evaluate(client: RolloutClient, config: RunConfig, prompts: list[Prompt], version: int, *,
                   on_group: Callable[[], None] | None = None) -> Evaluation:
    """Evaluate the adapter of `version` (which the application must serve: published, or 0 for the base model)
    on `prompts`. `on_group` is called as each prompt's images are scored (a progress bar). A group that fails
    after the client's retries raises `GroupFailed`."""
    began = time.perf_counter()
    requests = eval_requests(config, prompts, version)
    groups = []
    async for group in client.stream(requests):
        if group.trajectory.lora_version != version:  # pinned requests: a replica serves it or refuses
            raise RuntimeError(f"eval prompt {group.index} came from adapter version {group.trajectory.lora_version}, "
                               f"not {version}")
        groups.append(group)
        if on_group is not None:
            on_group()
    groups.sort(key=lambda g: g.index)
    return Evaluation(version=version, prompts=[str(p) for p in prompts], seeds=[r.seed for r in requests],
                      images=np.stack([g.trajectory.images.numpy() for g in groups]),
                      rewards=[g.rewards for g in groups], seconds=time.perf_counter() - began,
                      retries=sum(g.retries for g in groups))
