"""The adapter store: the one LoRA every rollout replica must serve, kept where a replica can always find it.

Publishing an adapter (`app.rollout.client.publish_lora`) writes it here first, then tells the live replicas to
load it (a Serve broadcast). The store `ray.put`s the adapter itself, so the object is owned by this long-lived
replica, not by the training worker that made it: a worker that dies and restarts takes nothing the rollout
needs with it. A rollout replica reads the store when it starts (Serve replacing one that died serves the current
adapter before its first request), and again whenever a request asks for a version it does not serve. If this
replica itself is restarted it comes back empty (the base model); the next publish refills it, and the trainer
regenerates any group that came from another version. A pipelined trainer's ranks `wait_for` a version before they
ask for groups pinned to it (`RolloutClient.collect_after`), so none waits for the broadcast itself.
"""

from __future__ import annotations

import asyncio
import contextlib

import ray

from app.types import PackedLora


class AdapterStore:
    def __init__(self, fingerprint: str = ""):
        self.version = 0  # 0: the base model
        self._ref = None  # ObjectRef of the LoraAdapter, owned by this replica
        self._fingerprint = fingerprint  # of the application it belongs to (`builders.app_fingerprint`)
        self._changed = asyncio.Condition()

    async def fingerprint(self) -> str:
        """What the application was built from (`deployments.builders.app_fingerprint`)."""
        return self._fingerprint

    async def publish(self, adapter: PackedLora | None) -> tuple[int, list]:
        """Keep `adapter` (None: back to the base model); returns what `current` returns. The packed buffer is read
        zero-copy from the object store and put again once, owned here."""
        self._ref = ray.put(adapter) if adapter is not None else None
        self.version = adapter.version if adapter is not None else 0
        async with self._changed:
            self._changed.notify_all()
        return await self.current()

    async def wait_for(self, version: int, timeout_s: float = 60.0) -> int:
        """The stored version, as soon as it is `version` or later (published meanwhile), or after `timeout_s`
        whatever it is (a restarted store holds the base model until the next publish)."""
        async with self._changed:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait_for(lambda: self.version >= version), timeout_s)
            return self.version

    async def current(self) -> tuple[int, list]:
        """(version, [ObjectRef of the adapter]) or (0, []). The ref travels wrapped in a list so that Ray hands it
        over as a reference: each replica fetches the object from the object store, not from this replica."""
        return self.version, ([self._ref] if self._ref is not None else [])
