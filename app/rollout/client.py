"""What the trainer uses to talk to the rollout and reward deployments: groups in, scored groups out (rewards
computed while other groups are still generating), and LoRA publication to every rollout replica.

It takes Serve `DeploymentHandle`s (from `deployments.client.handles`) and imports nothing of Serve itself.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import ray

from app.rewards import RewardScores
from app.rollout.types import GenerationRequest, LoraAdapter, Trajectory

logger = logging.getLogger(__name__)


@dataclass
class ScoredGroup:
    index: int  # position of its request
    trajectory: Trajectory
    rewards: RewardScores
    generated_at: float  # perf_counter when the group arrived
    scored_at: float


class RolloutClient:
    def __init__(self, rollout, reward, *, retries: int = 2, retry_delay_s: float = 2.0):
        self.rollout, self.reward = rollout, reward  # DeploymentHandles
        # a group whose replica died mid-request is asked again (Serve routes it to a live or restarted replica);
        # a rejected request (ValueError: bad input) is not retried
        self.retries, self.retry_delay_s = retries, retry_delay_s

    async def _score(self, index: int, traj: Trajectory) -> ScoredGroup:
        arrived = time.perf_counter()
        scores = await self.reward.score.remote(traj.images, [traj.prompt] * traj.group_size)
        return ScoredGroup(index, traj, scores, arrived, time.perf_counter())

    async def stream(self, requests: Sequence[GenerationRequest]) -> AsyncIterator[ScoredGroup]:
        """Scored groups in the order they finish; each is sent to the reward as soon as it is generated."""
        async def one(i: int, request: GenerationRequest) -> ScoredGroup:
            for attempt in range(self.retries + 1):
                try:
                    return await self._score(i, await self.rollout.generate.remote(request))
                except ValueError:
                    raise
                except Exception as err:  # replica lost, engine error: worth another try elsewhere
                    if attempt == self.retries:
                        raise
                    logger.warning("group %s failed (%s: %s); retrying", request.prompt_id, type(err).__name__, err)
                    await asyncio.sleep(self.retry_delay_s)

        for next_done in asyncio.as_completed([one(i, r) for i, r in enumerate(requests)]):
            yield await next_done

    async def collect(self, requests: Sequence[GenerationRequest], *, streamed: bool = True) -> list[ScoredGroup]:
        """All groups, in request order. streamed=False scores only after every rollout finished (the baseline)."""
        if streamed:
            groups = [g async for g in self.stream(requests)]
        else:
            trajs = await asyncio.gather(*[self.rollout.generate.remote(r) for r in requests])
            groups = await asyncio.gather(*[self._score(i, t) for i, t in enumerate(trajs)])
        return sorted(groups, key=lambda g: g.index)


async def publish_lora(rollout, adapter: LoraAdapter | None) -> list[int]:
    """Put the adapter in the object store once and load it on every live rollout replica (None: every replica
    goes back to the base model, version 0); returns when all replicas acknowledged the version (raises if one
    did not). Re-publishing the version a replica already serves is a no-op there."""
    version = adapter.version if adapter is not None else 0
    ref = ray.put(adapter)  # this process owns the object: it stays alive until the broadcast returns
    versions = await rollout.broadcast("load_lora", [ref]).results_async()
    if not versions or any(v != version for v in versions):
        raise RuntimeError(f"replicas answered {versions} to publishing version {version}")
    return versions
