"""The rollout replica: a `RolloutEngine` behind Serve's load balancer. A plain class (testable without Ray);
`builders.py` turns it into a deployment."""

from __future__ import annotations

import asyncio
import os
import socket
import time

from app.config import ModelConfig, RolloutConfig
from app.faults import crash_point, crash_point_in_request
from app.models.family import get_family
from app.types import GenerationRequest, LoraAdapter, PackedLora, RequestError, Trajectory


def make_engine(model: ModelConfig, rollout: RolloutConfig):
    """The engine `rollout.engine` names among the family's engines, for the checkpoint at `model.path`."""
    return get_family(model.family).engine_class(rollout.engine).from_config(model, rollout)


def _replica_id() -> str:
    try:
        from ray import serve

        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # outside Serve
        return f"{socket.gethostname()}:{os.getpid()}"


class AdapterUnavailable(RuntimeError):
    """A request asked for an adapter version that neither this replica nor the adapter store has (retryable:
    the trainer re-publishes)."""


class RolloutReplica:
    def __init__(self, model: ModelConfig, rollout: RolloutConfig, *, adapters=None, torch_threads: int | None = None):
        """The run config's sections, whole; adapters: handle of the `AdapterStore` deployment (None outside
        Serve: adapters only by `load_lora`)."""
        self.started = [time.time(), None]  # constructed, engine serving (app/startup.py)
        if torch_threads:
            import torch

            torch.set_num_threads(torch_threads)
        self.engine = make_engine(model, rollout)
        # the family's text limit, checked before any engine work (its tokenizer, loaded once)
        self.family = get_family(model.family)
        self.prompt_problem = self.family.prompt_checker(model.path)
        self.adapters = adapters
        self._adapter_lock = asyncio.Lock()  # a reset and the load that follows it happen together
        self.replica_id = _replica_id()

    async def start(self) -> None:
        await self.engine.start()
        await self.sync_adapter()  # a replica started in place of a dead one serves the published adapter at once
        self.started[1] = time.time()

    async def generate(self, request: GenerationRequest) -> Trajectory:
        if (problem := self.family.request_problem(request)) is not None:  # frames for images, or none for videos
            raise RequestError(problem[0], getattr(request, problem[0]), problem[1])
        if (problem := self.prompt_problem(request)) is not None:
            name, why = problem
            text = getattr(request, name)
            raise RequestError(name, f"{text[:32]}... ({len(text)} characters)" if len(text) > 40 else text, why)
        wanted = request.lora_version
        if wanted is not None and wanted != self.engine.lora_version:
            await self.sync_adapter()
            if wanted != self.engine.lora_version:
                raise AdapterUnavailable(f"the group asks for adapter version {wanted}; replica {self.replica_id} "
                                         f"serves {self.engine.lora_version}, the same as the adapter store")
        await crash_point_in_request("rollout.generate", request.group_id)  # tests only: dying mid-generation
        await crash_point_in_request("rollout.seed", request.seed)  # the same, for requests of no group (evals)
        traj = await self.engine.generate(request)
        traj.producer["replica"] = self.replica_id
        if self.started[1] is not None:
            traj.producer["replica_start"] = tuple(self.started)
        return traj

    async def sync_adapter(self) -> int:
        """Serve the adapter store's adapter if it differs from the one served; returns the version served."""
        if self.adapters is not None:
            version, refs = await self.adapters.current.remote()
            if version != self.engine.lora_version:
                await self.load_lora(refs or None)
        return self.engine.lora_version

    async def load_lora(self, adapter: LoraAdapter | PackedLora | list | None) -> int:
        """Serve a new adapter (None: the base model). `adapter` may be wrapped as `[ObjectRef]` (published once
        to the object store; wrapping keeps Ray from resolving it before this method decides to), and packed (one
        buffer: unpacked straight onto the engine's device)."""
        if isinstance(adapter, list):
            (ref,) = adapter
            adapter = await ref
        version = adapter.version if adapter is not None else 0
        crash_point("rollout.load_lora", version)  # tests only: a replica dying mid-publish
        async with self._adapter_lock:
            # served already: a request pinned to this version had this replica read the store before the broadcast
            # arrived (a run resets to the base model before it publishes a version number again)
            if version > 0 and version == self.engine.lora_version:
                return version
            if isinstance(adapter, PackedLora):  # off the event loop: requests go on being answered meanwhile
                adapter = await asyncio.to_thread(adapter.unpack, getattr(self.engine, "device", "cpu"))
            if 0 < version < self.engine.lora_version:  # a restarted run publishes an earlier version again
                await self.engine.load_lora(None)
            return await self.engine.load_lora(adapter)

    async def lora_version(self) -> dict:
        return {"replica": self.replica_id, "lora_version": self.engine.lora_version}

    async def health(self) -> dict:
        return {"replica": self.replica_id, **(await self.engine.health())}

    async def check_health(self) -> None:
        """Serve's periodic health check: an engine that cannot report is restarted."""
        await self.engine.health()
