"""Worker methods reachable through `AsyncOmni.collective_rpc`: weights arrive in memory, never through files.

vllm-omni adds its own `CustomPipelineWorkerExtension` for a custom pipeline only when no worker extension is
given, so this one subclasses it.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm_omni.diffusion.worker.diffusion_worker import CustomPipelineWorkerExtension

STAGED_VERSIONS_KEPT = 2  # a request already scheduled with the previous adapter can still (re)load it


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
        # evict the oldest staged, not the lowest id: after a reset to the base model, versions start again at 1
        for old in list(staged)[:-STAGED_VERSIONS_KEPT]:
            del staged[old]
            if self.lora_manager is not None:
                self.lora_manager.remove_adapter(old)
        if self.lora_manager is not None:  # a cached adapter with this id would shadow the new tensors
            self.lora_manager.remove_adapter(lora_int_id)
        return len(tensors)

    def update_weights(self, named_tensors: list[tuple[str, torch.Tensor]]) -> int:
        """Full weight update from diffusers-named tensors (`transformer.<name>`); returns how many loaded."""
        return len(self._pipeline.load_weights(iter(named_tensors)))

    def transformer_checksum(self) -> float:
        """Sum of the transformer's parameters in float64 (tests: a weight update took effect)."""
        return float(sum(p.double().sum().item() for n, p in self._pipeline.named_parameters()
                         if n.startswith("transformer.")))
