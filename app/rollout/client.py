"""What the trainer uses to talk to the rollout and reward deployments: groups in, scored groups out (rewards
computed while other groups are still generating; failed groups retried), and LoRA publication to every rollout
replica through the adapter store (`deployments/adapters.py`).

It takes Serve `DeploymentHandle`s (from `deployments.client.handles`) and imports nothing of Serve itself.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

import torch
from ray.exceptions import RayActorError
from ray.serve.exceptions import DeploymentUnavailableError

from app.rewards import RewardScores
from app.types import GenerationRequest, LoraAdapter, Trajectory

logger = logging.getLogger(__name__)


class GroupFailed(RuntimeError):
    """A prompt group that could not be generated or scored after every retry; the message names the group."""


class InvalidReward(RuntimeError):
    """The reward deployment answered, but not with one finite score per image."""


@dataclass
class ScoredGroup:
    index: int  # position of its request
    trajectory: Trajectory
    rewards: RewardScores
    generated_at: float  # perf_counter when the group arrived
    scored_at: float
    retries: int = 0  # failed attempts (generation or reward) before this one succeeded


@dataclass
class Publication:
    version: int
    acknowledged: int  # live replicas that now serve it
    lost: int  # replicas that died before answering (Serve replaces them; they load it from the store)
    seconds: float = 0.0  # from packing the adapter until every live replica answered that it serves it


def checked_scores(scores, n: int) -> RewardScores:
    """`scores` if it holds one finite total (and one value per component) for each of the n images."""
    if not isinstance(scores, RewardScores):
        raise InvalidReward(f"the reward returned {type(scores).__name__}, not RewardScores")
    lengths = {"total": len(scores.total), **{name: len(v) for name, v in scores.components.items()}}
    if any(length != n for length in lengths.values()):
        raise InvalidReward(f"the reward returned {lengths} scores for {n} images")
    values = [*scores.total, *(x for v in scores.components.values() for x in v)]
    if not all(isinstance(x, (int, float)) and math.isfinite(x) for x in values):
        raise InvalidReward("the reward returned a score that is not a finite number")
    return scores


def _describe(request: GenerationRequest) -> str:
    return f"group {request.group_id} ({request.prompt!r})"


def _short(err: BaseException) -> str:
    """`Type: first line of the message` of the exception a replica raised (a RayTaskError carries it as `cause`;
    the full remote traceback stays chained to the error raised here)."""
    cause = getattr(err, "cause", None) or err
    return f"{type(cause).__name__}: {(str(cause).strip().splitlines() or [''])[0]}"


class RolloutClient:
    def __init__(self, rollout, reward, adapters=None, *, retries: int = 3, retry_delay_s: float = 2.0,
                 publish_dtype: torch.dtype | None = None):
        """publish_dtype: what adapters travel in (the replicas' compute dtype; they cast to it anyway)."""
        self.rollout, self.reward, self.adapters = rollout, reward, adapters  # DeploymentHandles
        self.publish_dtype = publish_dtype
        # a group whose replica died mid-request, or whose reward failed, is asked again (Serve routes it to a live
        # or restarted replica); a rejected generation request (ValueError: bad input) is not retried
        self.retries, self.retry_delay_s = retries, retry_delay_s

    async def _attempts(self, what: str, request: GenerationRequest, call, *, retry_value_errors: bool):
        """(result, failed attempts) of `call()`, retried up to `self.retries` times."""
        for attempt in range(self.retries + 1):
            try:
                return await call(), attempt
            except Exception as err:  # replica lost, engine or reward error: worth another try elsewhere
                if isinstance(err, ValueError) and not retry_value_errors:
                    raise
                if attempt == self.retries:
                    raise GroupFailed(f"{_describe(request)}: {what} failed {attempt + 1} times; last error: "
                                      f"{_short(err)}") from err
                logger.warning("%s: %s failed (%s); retrying", _describe(request), what, _short(err))
            await asyncio.sleep(self.retry_delay_s)

    async def _one(self, index: int, request: GenerationRequest) -> ScoredGroup:
        traj, failed_generations = await self._attempts("generation", request,
                                                        lambda: self.rollout.generate.remote(request),
                                                        retry_value_errors=False)
        arrived = time.perf_counter()

        async def score() -> RewardScores:
            scores = await self.reward.score.remote(traj.images, [traj.prompt] * traj.group_size)
            return checked_scores(scores, traj.group_size)

        scores, failed_scorings = await self._attempts("reward", request, score, retry_value_errors=True)
        return ScoredGroup(index, traj, scores, arrived, time.perf_counter(), failed_generations + failed_scorings)

    async def stream(self, requests: Sequence[GenerationRequest]) -> AsyncIterator[ScoredGroup]:
        """Scored groups in the order they finish; each is sent to the reward as soon as it is generated. Should one
        fail for good, the others are cancelled (nobody will wait for them) before the error reaches the caller."""
        tasks = [asyncio.ensure_future(self._one(i, r)) for i, r in enumerate(requests)]
        try:
            for next_done in asyncio.as_completed(tasks):
                yield await next_done
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def collect(self, requests: Sequence[GenerationRequest], *, streamed: bool = True) -> list[ScoredGroup]:
        """All groups, in request order. streamed=False scores only after every rollout finished (the baseline)."""
        if streamed:
            groups = [g async for g in self.stream(requests)]
        else:
            trajs = await asyncio.gather(*[self.rollout.generate.remote(r) for r in requests])
            arrived = time.perf_counter()
            scores = await asyncio.gather(*[self.reward.score.remote(t.images, [t.prompt] * t.group_size)
                                            for t in trajs])
            groups = [ScoredGroup(i, t, checked_scores(s, t.group_size), arrived, time.perf_counter())
                      for i, (t, s) in enumerate(zip(trajs, scores, strict=True))]
        return sorted(groups, key=lambda g: g.index)

    async def publish(self, adapter: LoraAdapter | None) -> Publication:
        return await publish_lora(self.rollout, self.adapters, adapter, dtype=self.publish_dtype)

    async def collect_after(self, version: int, requests: Sequence[GenerationRequest], *,
                            timeout_s: float = 60.0) -> list[ScoredGroup]:
        """`collect` once the adapter store holds `version` or a later one (being published meanwhile, by this
        process or another rank's), every request pinned to the stored version: a replica the broadcast has not
        reached yet reads it from the store first, so nobody waits for the broadcast. Should the store not get
        there within `timeout_s` (it was restarted and holds the base model), the requests go unpinned and the
        trainer's staleness check regenerates what comes from another version."""
        if self.adapters is not None:
            stored = await self.adapters.wait_for.remote(version, timeout_s)
            if stored >= version:
                requests = [r.replace(lora_version=stored) for r in requests]
            else:
                logger.warning("the adapter store holds version %d, not %d, after %.0f s; generating with the "
                               "adapters the replicas have", stored, version, timeout_s)
        return await self.collect(requests)

    async def collect_on_policy(self, requests: Sequence[GenerationRequest],
                                adapter: LoraAdapter | None) -> tuple[list[ScoredGroup], int]:
        """All groups, in request order, every one sampled with `adapter` (the one last published; None: the base
        model), and how many had to be generated again. Each request names that version, and a replica serving
        another loads it from the adapter store first; should a group still come from another version (the store
        itself was restarted), it is regenerated after publishing again."""
        expected = adapter.version if adapter is not None else 0
        if any(r.lora_version != expected for r in requests):
            raise ValueError(f"requests must ask for adapter version {expected}, the one given")
        return await self.refresh(await self.collect(requests), requests, adapter, max_staleness=0)

    async def refresh(self, groups: list[ScoredGroup], requests: Sequence[GenerationRequest],
                      adapter: LoraAdapter | None, *, max_staleness: int) -> tuple[list[ScoredGroup], int]:
        """`groups` (in request order) with every group sampled more than `max_staleness` versions before
        `adapter` (the policy's, last published) generated again with `adapter` itself, and how many were. A
        group from a version newer than `adapter` (a replica still serving an earlier run's) counts as stale too:
        it was never this policy. The new requests name the version, so a replica loads it first."""
        current = adapter.version if adapter is not None else 0
        stale = [k for k, s in enumerate(groups) if not 0 <= current - s.trajectory.lora_version <= max_staleness]
        if not stale:
            return groups, 0
        await self.publish(adapter)  # a no-op on replicas already serving it
        again = await self.collect([requests[k] if requests[k].lora_version == current
                                    else requests[k].replace(lora_version=current) for k in stale])
        groups = list(groups)
        for k, s in zip(stale, again, strict=True):
            if s.trajectory.lora_version != current:
                raise RuntimeError(f"{_describe(requests[k])} came from adapter version "
                                   f"{s.trajectory.lora_version} after publishing version {current} again")
            groups[k] = s
        return groups, len(stale)


class BlockingRolloutClient:
    """A `RolloutClient` for synchronous code (a Ray Train worker's loop). Its coroutines run on one event loop in
    a thread of its own (Serve's handles stay bound to it): a call either runs to completion (`collect_on_policy`,
    `publish`, `refresh`) or goes on in the background while the caller trains (`collect_ahead`,
    `publish_ahead`: a `concurrent.futures.Future`). Use it as a context manager, or `close()`."""

    def __init__(self, client: RolloutClient):
        self.client = client
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="rollout-client", daemon=True)
        self._thread.start()

    def _submit(self, coro) -> Future:
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def call(self, coro):
        """Run a coroutine that uses `self.client` (e.g. an evaluation) on the client's loop; its result."""
        return self._submit(coro).result()

    def collect_on_policy(self, requests: Sequence[GenerationRequest],
                          adapter: LoraAdapter | None) -> tuple[list[ScoredGroup], int]:
        return self._submit(self.client.collect_on_policy(requests, adapter)).result()

    def collect_ahead(self, requests: Sequence[GenerationRequest], *, after: int | None = None) -> Future:
        """Generate and score `requests` in the background; the future's result is `collect`'s. after: an adapter
        version the requests wait for and are pinned to (`RolloutClient.collect_after`)."""
        if after is None:
            return self._submit(self.client.collect(requests))
        return self._submit(self.client.collect_after(after, requests))

    def refresh(self, groups: list[ScoredGroup], requests: Sequence[GenerationRequest], adapter: LoraAdapter | None,
                *, max_staleness: int) -> tuple[list[ScoredGroup], int]:
        return self._submit(self.client.refresh(groups, requests, adapter, max_staleness=max_staleness)).result()

    def publish(self, adapter: LoraAdapter | None) -> Publication:
        return self._submit(self.client.publish(adapter)).result()

    def publish_ahead(self, adapter: LoraAdapter | None) -> Future:
        """Publish in the background (the future's result is the `Publication`)."""
        return self._submit(self.client.publish(adapter))

    def close(self) -> None:
        """Cancel whatever still runs in the background (groups nobody will train on), then stop the loop."""
        if self._loop.is_closed():
            return

        async def cancel_the_rest():
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        try:
            self._submit(cancel_the_rest()).result(timeout=60)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=60)
            self._loop.close()

    def __enter__(self) -> BlockingRolloutClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


async def publish_lora(rollout, adapters, adapter: LoraAdapter | None, *,
                       dtype: torch.dtype | None = None) -> Publication:
    """Make `adapter` the one every rollout replica serves (None: the base model, version 0). It travels packed
    (`LoraAdapter.packed`: one buffer, in `dtype` if given), stored once and read by every replica.

    The adapter store keeps it first (it puts the adapter in the object store once and owns it), so a replica
    that starts later finds it; then every live replica loads it. A replica that dies before answering is
    counted, not fatal: Serve replaces it and the replacement loads the stored adapter before serving. Any
    other failure (a replica that answered with an error or another version) raises."""
    start = time.perf_counter()
    version, refs = await adapters.publish.remote(adapter.packed(dtype) if adapter is not None else None)
    try:
        answers = await rollout.broadcast("load_lora", refs or None).results_async(return_exceptions=True)
    except DeploymentUnavailableError:  # no replica runs yet (they start beside the trainer) or at this moment:
        answers = []  # each one that starts loads the stored adapter before it serves
    lost = [a for a in answers if isinstance(a, RayActorError)]
    errors = [a for a in answers if isinstance(a, BaseException) and not isinstance(a, RayActorError)]
    if errors:
        raise errors[0]
    acknowledged = [a for a in answers if not isinstance(a, BaseException)]
    if any(a != version for a in acknowledged):
        raise RuntimeError(f"replicas answered {acknowledged} to publishing version {version}")
    if lost:
        logger.warning("adapter version %d: %d rollout replica(s) died before loading it (%s); Serve replaces "
                       "them and the replacements load it from the adapter store", version, len(lost),
                       type(lost[0]).__name__)
    return Publication(version, len(acknowledged), len(lost), seconds=time.perf_counter() - start)
