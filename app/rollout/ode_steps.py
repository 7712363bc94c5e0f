"""Cheaper ODE steps outside the SDE window (`rollout.ode_steps`).

With an SDE window most of a group's steps take the deterministic ODE step: no noise is drawn there and the trainer
scores none of those transitions, so they may be computed more cheaply without changing any log-prob the loss uses
(the first pass stays exact). They do change the images a little, the reward's input: the runs that use this show
the reward distribution against the full computation.

Two ways, either or both: FP8 matmuls (`precision: fp8`) in the transformer blocks' linear layers, and diffusers'
First Block Cache (`cache: first_block`).

FP8: the blocks' linear layers (a LoRA's base layer included, its small A and B kept at the model's dtype) multiply
in float8 e4m3 through `torch._scaled_mm`, the weights scaled per output channel, the activations per row as they
come (the scaling torchao's rowwise float8 uses; `fp8_scaling: tensorwise`: one scale an operand, `fp8_fast_accum`:
the GEMM's faster accumulation). The weights' FP8 copy is made at the engine's load and again at the
first ODE step of a group whose weights changed since (an adapter folded into them, new base weights: the engine
counts those), in place in buffers kept on the layers: a replica holds half its blocks' bf16 bytes more. A layer
whose features are not multiples of 16 (what the GPU kernels take) stays as it is. The layers become `Fp8OdeLinear`
(an nn.Linear whose forward reads one switch) when their FP8 weights are first made, before any compilation: compiled
blocks guard on the switch's value, so every block shares one graph with it on and one with it off (a forward swapped
in per layer was guarded by its identity: a graph per block, past dynamo's limit, and eager from there on: 0.63x the
model's precision in a Z-Image job on one H100). Off the ODE steps their forward is nn.Linear's.

The cache: diffusers' First Block Cache (ParaAttention's dynamic caching, the idea of TeaCache): on an ODE step
the first transformer block runs, and when its residual moved less than `threshold` (mean absolute change relative
to the last fully computed one) the other blocks' residual from that step is reused instead of running them. The
window's steps run every block and the cache starts afresh after each of them, so a cached step never reaches back
across a scored one. Each transformer forward of a step (a family that runs its CFG branches apart makes two) keeps
its own cache, by its order in the step.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

CACHES = ("none", "first_block")  # "none", not "off": YAML reads off as false
PRECISIONS = ("model", "fp8")  # the model's own dtype, or FP8 matmuls in the blocks
SCALINGS = ("rowwise", "tensorwise")  # FP8's scales: per activation row and weight channel, or one per tensor
FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max


class OdeStepSwitch:
    """A cheaper way on during a group's ODE steps: `velocity` wraps the group's velocity so that `_switch(True)`
    runs before an ODE step after a window step (or the first) and `_switch(False)` before a window step after an ODE
    step; `close` switches it off at the group's end. A subclass says what switching does."""

    on = False

    def velocity(self, velocity: Callable, noise_levels: Sequence[float]) -> Callable:
        """`velocity(x, i)` with this way on at the steps of noise level 0 and off at the others."""

        def switched(x, i):
            ode = noise_levels[i] == 0
            if ode != self.on:
                self._switch(ode)
                self.on = ode
            self._step_begins()
            return velocity(x, i)

        return switched

    def close(self) -> None:
        if self.on:
            self._switch(False)
            self.on = False

    def _switch(self, on: bool) -> None:
        raise NotImplementedError

    def _step_begins(self) -> None:
        """Before each step's velocity."""


class OdeStepCache(OdeStepSwitch):
    """First Block Cache on `transformer` (a diffusers `CacheMixin` model) during the ODE steps of one group."""

    def __init__(self, transformer: torch.nn.Module, threshold: float):
        self.transformer, self.threshold = transformer, threshold
        self.blocks = _blocks(transformer)
        if len(self.blocks) < 2:
            raise ValueError(f"rollout.ode_steps.cache=first_block: {type(transformer).__name__} has "
                             f"{len(self.blocks)} transformer block(s); the cache needs a first block and others "
                             "to skip")
        self.forwards = 0  # transformer forwards in the current step: each names its cache
        self.ode_forwards = 0
        self.cached_forwards = 0  # ODE forwards that ran the first block only
        self._hooks = []

    def _step_begins(self) -> None:
        self.forwards = 0

    def stats(self) -> dict[str, int]:
        return {"ode_forwards": self.ode_forwards, "ode_forwards_cached": self.cached_forwards}

    def _switch(self, on: bool) -> None:
        from diffusers.hooks import FirstBlockCacheConfig

        if on:
            self.transformer.enable_cache(FirstBlockCacheConfig(threshold=self.threshold))
            self._hooks = [self.transformer.register_forward_pre_hook(self._name_the_cache),
                           self.transformer.register_forward_hook(self._count)]
        else:
            for hook in self._hooks:
                hook.remove()
            self.transformer.disable_cache()  # its states go with it: the next ODE steps start afresh

    def _states(self):
        """The cache's states (one state manager shared by every hooked block, read from the first block's hook)."""
        from diffusers.hooks import HookRegistry
        from diffusers.hooks.first_block_cache import _FBC_LEADER_BLOCK_HOOK

        return HookRegistry.check_if_exists_or_initialize(self.blocks[0]).get_hook(_FBC_LEADER_BLOCK_HOOK).state_manager

    def _name_the_cache(self, module, args) -> None:
        # on the state manager itself: the model's `cache_context` reaches the blocks through a list of their hook
        # registries it caches at its first use (a pipeline's `cache_context` before the cache was on leaves it empty)
        self._states().set_context(f"forward{self.forwards}")
        self.forwards += 1

    def _count(self, module, args, output) -> None:
        self.ode_forwards += 1
        self.cached_forwards += not self._states().get_state().should_compute


def _blocks(transformer: torch.nn.Module) -> list[torch.nn.Module]:
    """The blocks First Block Cache hooks, in its order (diffusers' block lists by their names)."""
    from diffusers.hooks._common import _ALL_TRANSFORMER_BLOCK_IDENTIFIERS

    return [block for name, child in transformer.named_children()
            if name in _ALL_TRANSFORMER_BLOCK_IDENTIFIERS and isinstance(child, torch.nn.ModuleList) for block in child]


class OdeStepFp8(OdeStepSwitch):
    """FP8 matmuls in `transformer`'s block linear layers during the ODE steps of one group."""

    def __init__(self, transformer: torch.nn.Module, fresh: bool = False, scaling: str = "rowwise",
                 fast_accum: bool = False):
        """fresh: the layers' FP8 weights were made from the weights as they stand, with this scaling (no remaking at
        the first ODE step); scaling: one of SCALINGS; fast_accum: the GEMM's faster, less precise accumulation
        (Hopper's; torchao's forward uses it)."""
        if scaling not in SCALINGS:
            raise ValueError(f"FP8 scaling {scaling!r}: use one of {list(SCALINGS)}")
        self.scaling, self.fast_accum = scaling, fast_accum
        self.layers = [layer for block in _blocks(transformer) for name, layer in block.named_modules()
                       if type(layer) in (torch.nn.Linear, Fp8OdeLinear) and "lora_" not in name
                       and layer.in_features % 16 == 0 and layer.out_features % 16 == 0]
        if not self.layers:
            raise ValueError(f"rollout.ode_steps.precision=fp8: {type(transformer).__name__}'s blocks have no linear "
                             "layer whose features are multiples of 16")
        self.quantize_s = 0.0  # this group's weight quantization (once, at its first ODE step, unless fresh)
        self.fresh = fresh

    def quantize(self) -> None:
        """The layers' FP8 weights from their weights as they stand. At the engine's load too: the buffers join the
        layers before any compilation sees them (added later, they fail its guards once: one more compilation)."""
        began = time.perf_counter()
        with torch.no_grad():
            for layer in self.layers:
                _quantize_weight(layer, self.scaling, self.fast_accum)
        if self.layers[0].weight.is_cuda:
            torch.cuda.synchronize(self.layers[0].weight.device)
        self.quantize_s += time.perf_counter() - began

    def stats(self) -> dict[str, float]:
        return {"ode_fp8_layers": len(self.layers), "ode_fp8_quantize_s": round(self.quantize_s, 4)}

    def _switch(self, on: bool) -> None:
        if on and not self.fresh:
            self.quantize()
            self.fresh = True
        for layer in self.layers:
            layer.ode_fp8 = on


def check_fp8_device(device: torch.device) -> None:
    """FP8 GEMMs need a GPU of compute capability 8.9 or newer (Ada, Hopper, Blackwell); the CPU has its own."""
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        raise ValueError(f"rollout.ode_steps.precision=fp8: {torch.cuda.get_device_name(device)} (compute capability "
                         f"{'.'.join(map(str, torch.cuda.get_device_capability(device)))}) has no FP8 matmuls; they "
                         "need 8.9 or newer (L4, L40S, H100, H200, B200): use rollout.ode_steps.precision=model")


def quantize(t: torch.Tensor, rowwise: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(`t` in float8 e4m3, its float32 scale): t ≈ q * scale, the largest magnitude of each row (`rowwise`; a scale
    per row) or of the whole tensor (one scale) at FP8's max."""
    amax = t.abs().amax(dim=-1, keepdim=True) if rowwise else t.abs().amax()
    scale = amax.float().clamp(min=1e-12) / FP8_MAX
    return (t.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


class Fp8OdeLinear(torch.nn.Linear):
    """An nn.Linear that multiplies in FP8 (`fp8_linear_forward`) while its switch `ode_fp8` is on."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ode_fp8:
            return fp8_linear_forward(self, x)
        return super().forward(x)


def _quantize_weight(layer: torch.nn.Linear, scaling: str = "rowwise", fast_accum: bool = False) -> None:
    """The layer's FP8 weight and its scale (per output channel, or one), written into the buffers it keeps for
    them; the scaling and accumulation its FP8 forward then uses."""
    rowwise = scaling == "rowwise"
    q, scale = quantize(layer.weight.detach(), rowwise)
    scale = scale.t().contiguous() if rowwise else scale  # rowwise: the scale as [1, out]
    if getattr(layer, "_ode_fp8_weight", None) is None or layer._ode_fp8_scale.shape != scale.shape:
        layer._ode_fp8_weight, layer._ode_fp8_scale = q, scale
        if type(layer) is not Fp8OdeLinear:
            layer.__class__, layer.ode_fp8 = Fp8OdeLinear, False  # the switch on the instance from the start
    else:
        layer._ode_fp8_weight.copy_(q)
        layer._ode_fp8_scale.copy_(scale)
    layer._ode_fp8_rowwise, layer._ode_fp8_fast_accum = rowwise, fast_accum


def fp8_linear_forward(layer: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """`layer(x)` with an FP8 matmul: x quantized per row and the weight per output channel, or each with one scale
    (`_quantize_weight`)."""
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    q, scale = quantize(rows, layer._ode_fp8_rowwise)
    # CUDA's rowwise-scaled FP8 GEMM writes bf16 only; the CPU's writes the input's dtype
    out_dtype = torch.bfloat16 if x.is_cuda else x.dtype
    y = torch._scaled_mm(q, layer._ode_fp8_weight.t(), scale_a=scale, scale_b=layer._ode_fp8_scale,
                         out_dtype=out_dtype, use_fast_accum=layer._ode_fp8_fast_accum).to(x.dtype)
    if layer.bias is not None:
        y = y + layer.bias
    return y.reshape(*x.shape[:-1], layer.out_features)
