"""The rollout engine protocol: what a Serve replica (and the trainer's tests) need from an engine."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from app.types import GenerationRequest, LoraAdapter, Trajectory


@runtime_checkable
class RolloutEngine(Protocol):
    kind: str  # "vllm_omni" or "diffusers"

    @property
    def lora_version(self) -> int:
        """Version of the adapter new requests are served with (0: the base model)."""

    async def start(self) -> None:
        """Load the model; idempotent."""

    async def generate(self, request: GenerationRequest) -> Trajectory:
        """One prompt group, tagged with the adapter version that produced it. Safe to call concurrently."""

    async def load_lora(self, adapter: LoraAdapter | None) -> int:
        """Serve `adapter` (None: the base model) for requests that start from now on; returns its version."""

    async def update_weights(self, named_tensors: dict[str, torch.Tensor]) -> int:
        """Replace transformer weights (diffusers names); returns how many tensors were loaded."""

    async def health(self) -> dict:
        """A small status dict: kind, model, lora_version, requests served, errors (and groups cancelled)."""

    async def close(self) -> None:
        """Release the model."""
