"""Cheaper ODE steps outside the SDE window (`rollout.ode_steps`).

With an SDE window most of a group's steps take the deterministic ODE step: no noise is drawn there and the trainer
scores none of those transitions, so they may be computed more cheaply without changing any log-prob the loss uses
(the first pass stays exact). They do change the images a little, the reward's input: the runs that use this show
the reward distribution against the full computation.

Cheaper here is diffusers' First Block Cache (ParaAttention's dynamic caching, the idea of TeaCache): on an ODE step
the first transformer block runs, and when its residual moved less than `threshold` (mean absolute change relative
to the last fully computed one) the other blocks' residual from that step is reused instead of running them. The
window's steps run every block and the cache starts afresh after each of them, so a cached step never reaches back
across a scored one. Each transformer forward of a step (a family that runs its CFG branches apart makes two) keeps
its own cache, by its order in the step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

CACHES = ("off", "first_block")


class OdeStepCache:
    """First Block Cache on `transformer` (a diffusers `CacheMixin` model) during the ODE steps of one group."""

    def __init__(self, transformer: torch.nn.Module, threshold: float):
        self.transformer, self.threshold = transformer, threshold
        self.blocks = _blocks(transformer)
        if len(self.blocks) < 2:
            raise ValueError(f"rollout.ode_steps.cache=first_block: {type(transformer).__name__} has "
                             f"{len(self.blocks)} transformer block(s); the cache needs a first block and others "
                             "to skip")
        self.on = False
        self.forwards = 0  # transformer forwards in the current step: each names its cache
        self.ode_forwards = 0
        self.cached_forwards = 0  # ODE forwards that ran the first block only
        self._hooks = []

    def velocity(self, velocity: Callable, noise_levels: Sequence[float]) -> Callable:
        """`velocity(x, i)` with the cache on at the steps of noise level 0 and off at the others."""

        def cached(x, i):
            ode = noise_levels[i] == 0
            if ode != self.on:
                self._switch(ode)
            self.forwards = 0
            return velocity(x, i)

        return cached

    def close(self) -> None:
        if self.on:
            self._switch(False)

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
        self.on = on

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
