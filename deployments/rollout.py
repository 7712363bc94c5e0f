"""The rollout replica: a `RolloutEngine` behind Serve's load balancer. A plain class (testable without Ray);
`builders.py` turns it into a deployment."""

from __future__ import annotations

import os
import socket

from app.rollout.types import GenerationRequest, LoraAdapter, Trajectory

ENGINES = ("vllm_omni", "diffusers")


def make_engine(kind: str, model_path: str, *, dtype: str = "float32", batched_groups: bool = True,
                max_num_seqs: int = 1):
    if kind == "vllm_omni":
        from app.rollout.vllm_omni.engine import VllmOmniEngine

        return VllmOmniEngine(model_path, dtype=dtype, batched_groups=batched_groups, max_num_seqs=max_num_seqs)
    if kind == "diffusers":
        from app.rollout.diffusers_engine import DiffusersEngine

        return DiffusersEngine(model_path, dtype=dtype)
    raise ValueError(f"engine={kind!r} is not one of {ENGINES}")


def _replica_id() -> str:
    try:
        from ray import serve

        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # outside Serve
        return f"{socket.gethostname()}:{os.getpid()}"


class RolloutReplica:
    def __init__(self, model_path: str, *, engine: str = "vllm_omni", dtype: str = "float32",
                 batched_groups: bool = True, max_num_seqs: int = 1, torch_threads: int | None = None):
        if torch_threads:
            import torch

            torch.set_num_threads(torch_threads)
        self.engine = make_engine(engine, model_path, dtype=dtype, batched_groups=batched_groups,
                                  max_num_seqs=max_num_seqs)
        self.replica_id = _replica_id()

    async def start(self) -> None:
        await self.engine.start()

    async def generate(self, request: GenerationRequest) -> Trajectory:
        traj = await self.engine.generate(request)
        traj.producer["replica"] = self.replica_id
        return traj

    async def load_lora(self, adapter: LoraAdapter | list | None) -> int:
        """Serve a new adapter. `adapter` may be wrapped as `[ObjectRef]` (a broadcast puts it in the object store
        once; wrapping keeps Ray from resolving it before this method decides to)."""
        if isinstance(adapter, list):
            (ref,) = adapter
            adapter = await ref
        return await self.engine.load_lora(adapter)

    async def lora_version(self) -> dict:
        return {"replica": self.replica_id, "lora_version": self.engine.lora_version}

    async def health(self) -> dict:
        return {"replica": self.replica_id, **(await self.engine.health())}

    async def check_health(self) -> None:
        """Serve's periodic health check: an engine that cannot report is restarted."""
        await self.engine.health()
