"""What the in-process reference engines share (Qwen-Image on diffusers, BAGEL in pure torch): loading off the
event loop, one group at a time under a lock, seeds, counters, and the LoRA as a peft adapter of the module that
`trained_module()` names. A subclass loads its model (`load_model`) and samples a group (`_generate`).

A new adapter is staged, not swapped in: `load_lora` returns at once, even while a group is being generated, and
the next group to start applies it (a copy into the adapter's parameters, timed as `producer["adapter_swap_s"]`).
A group is sampled whole with the adapter it started with, and publishing never waits for generation.

Compiled engines keep one module structure and one `requires_grad` state for the whole run, since dynamo guards on
both and compiles again when either changes (seen on the GPU: a replica compiled anew when the first trained
adapter arrived). So an engine built for a run's LoRA (`lora`) holds that adapter from the start with B = 0, which
is the base model exactly; the base model later (`load_lora(None)`) is that adapter zeroed again rather than
disabled; and the module stays frozen (peft's `set_adapter` marks an adapter trainable).

With `merge_lora` ("device", "host" or "auto": where the base weights' copy is kept; None: off) the adapter is
folded into the weights instead (app/models/lora_merge.py): no peft layers at all, the module a compiled block sees
is the base model's, and each version costs one fp32 recomputation of the adapted weights at the swap.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from pathlib import Path

import torch

from app.metrics import PhaseTimer
from app.models.attention import use_sdpa_kernels
from app.models.compile import apply_compile, cache_counts, compile_counts
from app.models.family import get_family
from app.models.lora import (
    ADAPTER_NAME,
    LoraShape,
    add_zero_lora,
    attach_lora,
    copy_into_lora,
    target_layers,
    transformer_key,
)
from app.models.lora_merge import KEEP_ON, MergedLora
from app.models.precision import exact_fp32
from app.rollout.ode_steps import OdeStepCache, OdeStepFp8, check_fp8_device
from app.rollout.seeding import draw_seed
from app.types import GenerationRequest, LoraAdapter, RequestError, Trajectory


class GroupCancelled(Exception):
    """The group's caller gave up: it stopped between two denoising steps (nobody waits for its result)."""


def _stop_if_cancelled(engine) -> None:
    event = engine._group_cancelled
    if event is not None and event.is_set():
        raise GroupCancelled("the caller cancelled the group")


def _beneath_peft(name: str, module: torch.nn.Module) -> str:
    """A base weight's name as it stands in `module`: a layer a peft adapter wraps keeps it as `base_layer`."""
    stem, _, leaf = name.rpartition(".")
    wrapped = f"{stem}.base_layer.{leaf}"
    try:
        module.get_parameter(wrapped)
    except AttributeError:
        return name
    return wrapped


class LocalEngine:
    kind = "local"
    family = ""  # the model family (app/models/) a subclass serves
    # `rollout.ode_steps`: First Block Cache's threshold on the ODE steps outside the SDE window (None: off)
    ode_cache_threshold: float | None = None
    # `rollout.ode_steps.precision: fp8`: FP8 matmuls in the blocks on those steps
    ode_fp8: bool = False
    ode_fp8_scaling: str = "rowwise"  # `rollout.ode_steps.fp8_scaling`
    ode_fp8_fast_accum: bool = False  # `rollout.ode_steps.fp8_fast_accum`

    def __init__(self, model_path: str | os.PathLike, *, dtype: str = "float32", device: str | None = None,
                 compile=None, lora: LoraShape | None = None, merge_lora: str | None = None,
                 attention_kernels: list[str] | None = None):
        """compile: a `model.compile` section (None or off: eager); lora: the shape of the adapters this engine will
        serve (a run's model section), held from the start as the zero adapter (None: added when one arrives);
        merge_lora: None (a peft adapter beside the weights), or fold it into them, keeping the base weights' copy
        on the "device", the "host" or where it fits ("auto": decided at the first adapter; `merged_base_on`
        says where) (`rollout.merge_lora`, `rollout.merged_base_on`); attention_kernels: the
        kernels torch's attention may choose among in this process (`model.attention_kernels`; None: torch's)."""
        if merge_lora not in (None, *KEEP_ON):
            raise ValueError(f"merge_lora={merge_lora!r}: use None, {', '.join(KEEP_ON)}")
        self.model_path = str(Path(model_path).resolve())
        self.compile = compile
        self.lora = lora
        self.merge_lora = merge_lora
        self.attention_kernels = attention_kernels
        self._merged: MergedLora | None = None  # the folded adapter (merge_lora on)
        self.compiled = False
        self.dtype = getattr(torch, dtype)
        exact_fp32(self.dtype)
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.loaded = False
        self._lock = threading.Lock()  # one group at a time on the shared modules
        self._lora_version = 0  # the adapter applied to the module (what a group started now is tagged with)
        self._staged_lock = threading.Lock()
        self._staged: tuple[LoraAdapter | None] | None = None  # (adapter,) waiting for the next group; None: none
        self._served = 0
        self._errors = 0
        self._cancelled = 0  # groups whose caller gave up, stopped early
        self._group_cancelled: threading.Event | None = None  # the running group's, set when its caller gives up
        self.phases = PhaseTimer()  # the group being generated: `with self.phases("denoise"): ...`
        self._ode_stats: dict[str, int] = {}  # the last group's cached ODE steps (`cheaper_ode_steps`)
        # the module's weights change with a folded adapter and `update_weights`: the FP8 copy is remade only then
        self._weights_generation = 0
        self._fp8_made: tuple | None = None  # the weights' generation, scaling and accumulation of the FP8 copy

    @classmethod
    def from_config(cls, model, rollout) -> LocalEngine:
        """The engine of a run config's model and rollout sections."""
        engine = cls(model.path, dtype=model.dtype, compile=model.compile, lora=LoraShape.of(model),
                     merge_lora=str(rollout.merged_base_on) if rollout.merge_lora else None,
                     attention_kernels=model.attention_kernels)
        if rollout.ode_steps.cache == "first_block":
            engine.ode_cache_threshold = rollout.ode_steps.threshold
        engine.ode_fp8 = rollout.ode_steps.precision == "fp8"
        engine.ode_fp8_scaling = rollout.ode_steps.fp8_scaling
        engine.ode_fp8_fast_accum = rollout.ode_steps.fp8_fast_accum
        return engine

    # ---- what a subclass provides ----------------------------------------------------------------------------

    def load_model(self) -> None:
        """Load the model onto `self.device` (called once, under the lock)."""
        raise NotImplementedError

    @property
    def merged_base_on(self) -> str | None:
        """Where a merging engine keeps the base weights' copy ("auto" until the first adapter); None: not merging."""
        return self._merged.keep_on if self._merged is not None else self.merge_lora

    def trained_module(self) -> torch.nn.Module:
        """The module the LoRA adapts (and `update_weights` writes)."""
        raise NotImplementedError

    def _generate(self, request: GenerationRequest, seed: int) -> Trajectory:
        """One group, sampled with `seed` (under the lock, without gradients)."""
        raise NotImplementedError

    # ---- the engine protocol ---------------------------------------------------------------------------------

    @property
    def lora_version(self) -> int:
        """The version a group started now is sampled with: the staged adapter's, else the applied one's."""
        with self._staged_lock:
            staged = self._staged
        if staged is None:
            return self._lora_version
        return staged[0].version if staged[0] is not None else 0

    def load(self) -> None:
        with self._lock:
            if not self.loaded:
                use_sdpa_kernels(self.attention_kernels)
                if self.ode_fp8:
                    check_fp8_device(self.device)  # before the weights are read: a clear error at the start
                self.load_model()
                module = self.trained_module()
                if self.merge_lora is not None:
                    self._merged = MergedLora(module, keep_on=self.merge_lora)
                    if self.lora is not None:  # the layers every adapter of the run adapts: their copies now
                        self._merged.keep_ahead(target_layers(module, self.lora.target_modules))
                elif self.lora is not None:
                    add_zero_lora(module, self.lora)
                module.requires_grad_(False)
                if self.ode_fp8:
                    self.fp8_step(module).quantize()
                    self._fp8_made = self._fp8_wanted()
                module.register_forward_pre_hook(lambda *_: _stop_if_cancelled(self))  # every denoising step
                self.compiled = apply_compile(module, get_family(self.family), self.compile, inference=True) > 0
                self.loaded = True

    async def start(self) -> None:
        if not self.loaded:
            await asyncio.to_thread(self.load)

    def _generate_locked(self, request: GenerationRequest, seed: int,
                         cancelled: threading.Event | None = None) -> Trajectory:
        with self._lock, torch.no_grad():
            self._group_cancelled = cancelled
            try:
                _stop_if_cancelled(self)
                frames = compile_counts()["frames"] if self.compiled else 0
                swap = self._apply_staged()
                started = time.perf_counter()
                self.phases = PhaseTimer(sync=torch.cuda.synchronize if self.device.type == "cuda" else None)
                traj = self._generate(request, seed)
            finally:
                self._group_cancelled = None  # another caller's work (a plain generation) is not stopped
            traj.producer.update({"engine": self.kind, "pid": os.getpid(),
                                  "seconds": time.perf_counter() - started, "adapter_swap_s": swap,
                                  "phase_s": dict(self.phases.seconds)})  # encode / denoise / decode
            if self.compiled:  # steady state: the first stops growing and the second is 0 after the first groups
                traj.producer["compile_frames"] = compile_counts()["frames"]
                traj.producer["compile_frames_new"] = traj.producer["compile_frames"] - frames  # for this group
                traj.producer["compile_cache"] = cache_counts()  # this process's hits and misses so far
            if self.device.type == "cuda":
                traj.producer["gpu_peak_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
            traj.producer.update(self._ode_stats)
            return traj

    @contextlib.contextmanager
    def cheaper_ode_steps(self, request: GenerationRequest):
        """Yields what a group's velocity is wrapped in while it is sampled: on its ODE steps, with `rollout.ode_steps`
        on, FP8 matmuls and / or First Block Cache (ode_steps.py); the velocity itself otherwise. Their counts go to
        the producer."""
        self._ode_stats = {}
        levels = request.step_noise_levels
        cheaper = []
        if any(level == 0 for level in levels):
            if self.ode_cache_threshold is not None:
                cheaper.append(OdeStepCache(self.trained_module(), self.ode_cache_threshold))
            if self.ode_fp8:
                fresh = self._fp8_made == self._fp8_wanted()
                cheaper.append(self.fp8_step(self.trained_module(), fresh=fresh))

        def wrap(velocity):
            for way in cheaper:
                velocity = way.velocity(velocity, levels)
            return velocity

        try:
            yield wrap
        finally:
            for way in cheaper:
                way.close()
                self._ode_stats.update(way.stats())
                if isinstance(way, OdeStepFp8) and way.fresh:  # made with this engine's settings (`fp8_step`)
                    self._fp8_made = self._fp8_wanted()

    def _fp8_wanted(self) -> tuple:
        return self._weights_generation, self.ode_fp8_scaling, self.ode_fp8_fast_accum

    def fp8_step(self, module: torch.nn.Module, fresh: bool = False) -> OdeStepFp8:
        """FP8 ODE steps on `module` with this engine's scaling and accumulation (`rollout.ode_steps`)."""
        return OdeStepFp8(module, fresh=fresh, scaling=self.ode_fp8_scaling, fast_accum=self.ode_fp8_fast_accum)

    def sample(self, request: GenerationRequest) -> Trajectory:
        """`generate` for synchronous code in one process (no event loop): the single-GPU baseline."""
        self.load()
        return self._generate_locked(request, request.seed if request.seed is not None else draw_seed())

    async def generate(self, request: GenerationRequest) -> Trajectory:
        if not isinstance(request, GenerationRequest):
            raise TypeError(f"expected a GenerationRequest, got {type(request).__name__}")
        if (problem := get_family(self.family).request_problem(request)) is not None:  # frames: videos or images
            raise RequestError(problem[0], getattr(request, problem[0]), problem[1])
        await self.start()
        seed = request.seed if request.seed is not None else draw_seed()
        cancelled = threading.Event()
        try:
            traj = await asyncio.to_thread(self._generate_locked, request, seed, cancelled)
        except asyncio.CancelledError:
            # the caller gave up (an HTTP client that disconnected): the group stops at its next denoiser forward,
            # or before it starts if it still waits for the lock, so the next group starts at once
            cancelled.set()
            self._cancelled += 1
            raise
        except Exception:
            self._errors += 1
            raise
        self._served += 1
        return traj

    def _load_lora(self, adapter: LoraAdapter | None) -> int:
        """Stage `adapter` (None: the base model) for the next group; returns its version."""
        with self._staged_lock:
            self._staged = (adapter,)
        return adapter.version if adapter is not None else 0

    def _apply_staged(self) -> float:
        """Swap the staged adapter in (under the generation lock); the seconds it took (0.0: nothing staged)."""
        with self._staged_lock:
            staged, self._staged = self._staged, None
        if staged is None:
            return 0.0
        started = time.perf_counter()
        (adapter,) = staged
        if self._merged is not None:
            self._weights_generation += 1  # before: a failure halfway changed them too
            try:
                self._merged.apply(adapter)
            except Exception:
                if self._merged.adapter is None:  # a failure halfway left the base model
                    self._lora_version = 0
                raise
            self._lora_version = adapter.version if adapter is not None else 0
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            return time.perf_counter() - started
        module = self.trained_module()
        current = (getattr(module, "peft_config", None) or {}).get(ADAPTER_NAME)
        if adapter is None:
            if current is not None:  # B = 0: the base model exactly, through the graph the adapters use
                with torch.no_grad():
                    torch._foreach_zero_([p for n, p in module.named_parameters()
                                          if f".lora_B.{ADAPTER_NAME}." in n])
            self._lora_version = 0
            return time.perf_counter() - started
        same = current is not None and (current.r, current.lora_alpha, sorted(current.target_modules)) == (
            adapter.rank, adapter.alpha, sorted(adapter.target_modules))
        if current is not None and not same:
            module.delete_adapters(ADAPTER_NAME)  # a different rank/targets: start a fresh adapter
        if not (same and copy_into_lora(module, adapter, ADAPTER_NAME)):  # the next version: a device copy
            attach_lora(module, adapter, ADAPTER_NAME)
        module.enable_adapters()
        module.set_adapter(ADAPTER_NAME)
        module.requires_grad_(False)  # peft marks the active adapter trainable: a new guard for a compiled block
        self._lora_version = adapter.version
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the copy onto the adapter's parameters is part of the swap
        return time.perf_counter() - started

    async def load_lora(self, adapter: LoraAdapter | None) -> int:
        await self.start()
        return self._load_lora(adapter)

    async def update_weights(self, named_tensors: dict[str, torch.Tensor]) -> int:
        await self.start()

        def load() -> int:
            with self._lock:
                self._apply_staged()  # an adapter published before these weights applies to the old ones first
                state = {transformer_key(k): v for k, v in named_tensors.items()}
                self._weights_generation += 1
                if self._merged is not None:  # the new weights are the base the adapter is folded into
                    unknown = self._merged.load_base(state)
                    if unknown:
                        raise ValueError(f"unknown transformer weights: {unknown[:3]}")
                    return len(state)
                module = self.trained_module()
                state = {_beneath_peft(k, module): v for k, v in state.items()}
                unknown = sorted(set(state) - set(module.state_dict()))
                if unknown:  # before any is written: a bad name changes nothing
                    raise ValueError(f"unknown transformer weights: {unknown[:3]}")
                module.load_state_dict(state, strict=False)
                return len(state)

        return await asyncio.to_thread(load)

    async def health(self) -> dict:
        return {"kind": self.kind, "model": self.model_path, "started": self.loaded,
                "lora_version": self.lora_version, "lora_merged": self.merge_lora is not None,
                "merged_base_on": self.merged_base_on, "served": self._served, "errors": self._errors,
                "cancelled": self._cancelled}

    async def close(self) -> None:
        self.loaded = False
