"""What the in-process reference engines share (Qwen-Image on diffusers, BAGEL in pure torch): loading off the
event loop, one group at a time under a lock, seeds, counters, and the LoRA as a peft adapter of the module that
`trained_module()` names. A subclass loads its model (`load_model`) and samples a group (`_generate`).
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from pathlib import Path

import torch

from app.models.lora import ADAPTER_NAME, attach_lora, transformer_key
from app.rollout.seeding import draw_seed
from app.types import GenerationRequest, LoraAdapter, Trajectory


class LocalEngine:
    kind = "local"

    def __init__(self, model_path: str | os.PathLike, *, dtype: str = "float32", device: str | None = None):
        self.model_path = str(Path(model_path).resolve())
        self.dtype = getattr(torch, dtype)
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.loaded = False
        self._lock = threading.Lock()  # one group at a time on the shared modules
        self._lora_version = 0
        self._served = 0
        self._errors = 0

    # ---- what a subclass provides ----------------------------------------------------------------------------

    def load_model(self) -> None:
        """Load the model onto `self.device` (called once, under the lock)."""
        raise NotImplementedError

    def trained_module(self) -> torch.nn.Module:
        """The module the LoRA adapts (and `update_weights` writes)."""
        raise NotImplementedError

    def _generate(self, request: GenerationRequest, seed: int) -> Trajectory:
        """One group, sampled with `seed` (under the lock, without gradients)."""
        raise NotImplementedError

    # ---- the engine protocol ---------------------------------------------------------------------------------

    @property
    def lora_version(self) -> int:
        return self._lora_version

    def load(self) -> None:
        with self._lock:
            if not self.loaded:
                self.load_model()
                self.loaded = True

    async def start(self) -> None:
        if not self.loaded:
            await asyncio.to_thread(self.load)

    def _generate_locked(self, request: GenerationRequest, seed: int) -> Trajectory:
        with self._lock, torch.no_grad():
            started = time.perf_counter()
            traj = self._generate(request, seed)
            traj.producer.update({"engine": self.kind, "pid": os.getpid(),
                                  "seconds": time.perf_counter() - started})
            if self.device.type == "cuda":
                traj.producer["gpu_peak_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
            return traj

    def sample(self, request: GenerationRequest) -> Trajectory:
        """`generate` for synchronous code in one process (no event loop): the single-GPU baseline."""
        self.load()
        return self._generate_locked(request, request.seed if request.seed is not None else draw_seed())

    async def generate(self, request: GenerationRequest) -> Trajectory:
        if not isinstance(request, GenerationRequest):
            raise TypeError(f"expected a GenerationRequest, got {type(request).__name__}")
        await self.start()
        seed = request.seed if request.seed is not None else draw_seed()
        try:
            traj = await asyncio.to_thread(self._generate_locked, request, seed)
        except Exception:
            self._errors += 1
            raise
        self._served += 1
        return traj

    def _load_lora(self, adapter: LoraAdapter | None) -> int:
        with self._lock:
            module = self.trained_module()
            current = (getattr(module, "peft_config", None) or {}).get(ADAPTER_NAME)
            if adapter is None:
                if current is not None:
                    module.disable_adapters()
                self._lora_version = 0
                return 0
            if current is not None and (current.r, current.lora_alpha, sorted(current.target_modules)) != (
                    adapter.rank, adapter.alpha, sorted(adapter.target_modules)):
                module.delete_adapters(ADAPTER_NAME)  # a different rank/targets: start a fresh adapter
            attach_lora(module, adapter, ADAPTER_NAME)
            module.enable_adapters()
            module.set_adapter(ADAPTER_NAME)
            self._lora_version = adapter.version
            return adapter.version

    async def load_lora(self, adapter: LoraAdapter | None) -> int:
        await self.start()
        return await asyncio.to_thread(self._load_lora, adapter)

    async def update_weights(self, named_tensors: dict[str, torch.Tensor]) -> int:
        await self.start()

        def load() -> int:
            with self._lock:
                state = {transformer_key(k): v for k, v in named_tensors.items()}
                result = self.trained_module().load_state_dict(state, strict=False)
                if result.unexpected_keys:
                    raise ValueError(f"unknown transformer weights: {result.unexpected_keys[:3]}")
                return len(state)

        return await asyncio.to_thread(load)

    async def health(self) -> dict:
        return {"kind": self.kind, "model": self.model_path, "started": self.loaded,
                "lora_version": self._lora_version, "served": self._served, "errors": self._errors}

    async def close(self) -> None:
        self.loaded = False
