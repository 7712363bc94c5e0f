"""Worker methods reachable through `AsyncOmni.collective_rpc`: weights arrive in memory, never through files.

vllm-omni adds its own `CustomPipelineWorkerExtension` for a custom pipeline only when no worker extension is
given, so this one subclasses it.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from vllm_omni.diffusion.worker.diffusion_worker import CustomPipelineWorkerExtension

from app.rollout.vllm_omni.lora import BASE_LORA_ID
from app.rollout.vllm_omni.merge import CheckpointMerge

STAGED_VERSIONS_KEPT = 2  # a request already scheduled with the previous adapter can still (re)load it


@contextlib.contextmanager
def base_layers(module: torch.nn.Module):
    """vLLM's LoRA layers (installed at the first adapter served) wrap each adapted layer, whose weight is then named
    `<layer>.base_layer.weight`; vllm-omni's loader looks parameters up by the checkpoint's names and skipped those
    silently. While this is open the wrappers step aside: their base layers (the same parameters) are in place."""
    swapped = []
    for name, child in list(module.named_modules()):
        base = getattr(child, "base_layer", None)
        if isinstance(base, torch.nn.Module) and type(child).__name__.endswith("WithLoRA"):
            parent_name, _, attr = name.rpartition(".")
            parent = module.get_submodule(parent_name) if parent_name else module
            setattr(parent, attr, base)
            swapped.append((parent, attr, child))
    try:
        yield
    finally:
        for parent, attr, child in swapped:
            setattr(parent, attr, child)


class FlowGRPOWorkerExtension(CustomPipelineWorkerExtension):
    @property
    def _pipeline(self):
        return self.model_runner.pipeline

    def stage_lora(self, lora_int_id: int, tensors: dict[str, torch.Tensor], peft_config: dict[str, Any]) -> int:
        """Keep a LoRA's tensors in memory under `lora_int_id`; requests naming that id load it from here."""
        pipe = self._pipeline
        staged = getattr(pipe, "_staged_loras", None)
        if staged is None:
            staged = pipe._staged_loras = {}
        staged.pop(lora_int_id, None)  # re-staged: now the newest
        staged[lora_int_id] = ({k: v.to("cpu") for k, v in tensors.items()}, dict(peft_config))
        # evict the oldest staged, not the lowest id: after a reset to the base model, versions start again at 1;
        # the zero adapter a compiled engine serves for the base model stays
        for old in [i for i in staged if i != BASE_LORA_ID][:-STAGED_VERSIONS_KEPT]:
            del staged[old]
            if self.lora_manager is not None:
                self.lora_manager.remove_adapter(old)
        if self.lora_manager is not None:  # a cached adapter with this id would shadow the new tensors
            self.lora_manager.remove_adapter(lora_int_id)
        return len(tensors)

    @property
    def _merge(self) -> CheckpointMerge:
        pipe = self._pipeline
        merge = getattr(pipe, "_flowgrpo_merge", None)
        if merge is None:
            weight = next(pipe.transformer.parameters())
            merge = pipe._flowgrpo_merge = CheckpointMerge(self.load_weights, pipe.od_config.model,
                                                           dtype=weight.dtype, device=weight.device)
        return merge

    def merge_lora(self, layers: dict[str, tuple[torch.Tensor, torch.Tensor]], scale: float) -> int:
        """Fold an adapter {layer: (A, B)} at `scale` into the transformer's weights ({}: the base model again);
        returns how many layers hold it (merge.py)."""
        return self._merge.apply(layers, scale)

    def keep_lora_base(self, target_modules: list[str]) -> int:
        """Start reading the base weights of the layers a LoRA on `target_modules` adapts (merge.py `keep_ahead`);
        returns at once, with how many layers."""
        return self._merge.keep_ahead(target_modules)

    def load_weights(self, named_tensors) -> set[str]:
        """The pipeline's weight loader on (pipeline name, tensor) pairs, vLLM's LoRA layers stepped aside."""
        pipe = self._pipeline
        with base_layers(pipe.transformer):
            return pipe.load_weights(named_tensors)

    def update_weights(self, named_tensors: list[tuple[str, torch.Tensor]]) -> int:
        """Full weight update from diffusers-named tensors (`transformer.<name>`); returns how many loaded. A
        tensor no parameter took is an error (vllm-omni's loader skips unknown names silently)."""
        loaded = self.load_weights(iter(named_tensors))
        lost = [name for name, _ in named_tensors if name not in loaded]
        if lost:
            raise ValueError(f"{len(lost)} weights fit no parameter of vllm-omni's transformer, e.g. {lost[0]!r}")
        return len(named_tensors)

    def transformer_checksum(self) -> float:
        """Sum of the transformer's parameters in float64 (tests: a weight update took effect)."""
        return float(sum(p.double().sum().item() for n, p in self._pipeline.named_parameters()
                         if n.startswith("transformer.")))

    def lora_state(self) -> dict[str, Any]:
        """The staged adapters' ids, oldest first, and the id vLLM's LoRA layers serve now (None: no LoRA layers or
        none active; read from vllm-omni's manager). Tests: which adapter a group went through."""
        manager = self.lora_manager
        return {"staged": list(getattr(self._pipeline, "_staged_loras", {})),
                "active": None if manager is None else manager._active_adapter_id}
