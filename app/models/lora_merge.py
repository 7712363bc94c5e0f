"""A published LoRA folded into the weights it adapts (W = W0 + (α/r)·B·A), for a rollout engine that serves one
adapter at a time: the generation runs the base model's matmuls only, with no LoRA branch beside each adapted layer.

Each version is computed from a kept copy of W0 in fp32 and rounded once to the weight's dtype, so swapping
adapters never drifts (adding the new product and subtracting the old in bf16 would round at every version), and
the base model comes back bit for bit. The copies are taken the first time an adapter touches a layer: on the
weight's device (fast, a second copy of the adapted weights in its memory) or in pinned host memory (no GPU
memory, one host-to-device copy per layer and version); "auto" chooses at the first adapter, by the GPU's free
memory then. Pinned host copies are slow to take (27 GB of Qwen-Image's adapted layers: about 27 s on an H100
host), so an engine that knows its adapters' targets takes them in the background from the start (`keep_ahead`).

The merged forward is not the trainer's unmerged one in bf16 (x·Wᵀ rounds differently from x·W0ᵀ + x·Aᵀ·Bᵀ·α/r),
so a run that merges takes its old log-probs from the trainer (`train.old_logprob: trainer` or `recompute`).
"""

from __future__ import annotations

import logging
import threading

import torch

from app.models.lora import lora_module, transformer_key
from app.types import LoraAdapter

KEEP_ON = ("device", "host", "auto")
# "auto" keeps the copy on the device when it takes at most this share of the GPU's free memory at the first
# adapter, leaving the rest to the generation's activations. In a run the first adapter is published after the
# first trained step, so a trainer rank sharing the GPU holds its peak by then (torch's allocator keeps it)
AUTO_DEVICE_SHARE = 0.5


def adapter_layers(adapter: LoraAdapter) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{module name: (A [r, in], B [out, r])} of an adapter's tensors (peft or diffusers names)."""
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in adapter.tensors.items():
        side = "A" if ".lora_A." in key else "B"  # LoraAdapter admits no other names
        parts.setdefault(lora_module(transformer_key(key)), {})[side] = tensor
    missing = [m for m, p in parts.items() if len(p) != 2]
    if missing:
        raise ValueError(f"LoRA layer {missing[0]!r} has only one of lora_A / lora_B")
    return {m: (p["A"], p["B"]) for m, p in parts.items()}


def folded(base: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float, device) -> torch.Tensor:
    """W0 + scale·B·A on `device`, computed in fp32 (or a float64 model's own dtype) from W0 [out, in], A [r, in] and
    B [out, r]: the caller rounds it once to the weight's dtype."""
    work = torch.promote_types(base.dtype, torch.float32)
    return torch.addmm(base.to(device, work, non_blocking=True), b.to(device, work, non_blocking=True),
                       a.to(device, work, non_blocking=True), alpha=scale)


def auto_keep_on(copy_bytes: int, free_bytes: int | None) -> str:
    """Where "auto" keeps a copy of `copy_bytes`: "device" if it takes at most AUTO_DEVICE_SHARE of the GPU's
    `free_bytes` (None: the weights are not on a GPU, where device and host are one memory), else "host"."""
    return "device" if free_bytes is None or copy_bytes <= AUTO_DEVICE_SHARE * free_bytes else "host"


class KeptAhead:
    """Base copies taken in a background thread before the first adapter (`keep_ahead`); `wait()` before the weights
    change. A failure is logged and left to the first fold, which takes what is missing as it would have anyway."""

    def __init__(self):
        self._thread: threading.Thread | None = None

    def start(self, keep, names: list[str]) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, args=(keep, names), name="lora-base-copies",
                                            daemon=True)
            self._thread.start()

    @property
    def started(self) -> bool:
        return self._thread is not None

    @staticmethod
    def _run(keep, names: list[str]) -> None:
        try:
            with torch.no_grad():
                keep(names)
        except Exception:
            logging.getLogger(__name__).exception("taking the base weights' copies ahead failed")

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()


class MergedLora:
    """Folds one adapter at a time into `module`'s weights; `apply(None)` is the base model again."""

    def __init__(self, module: torch.nn.Module, *, keep_on: str = "device"):
        if keep_on not in KEEP_ON:
            raise ValueError(f"keep_on={keep_on!r}: use one of {KEEP_ON}")
        self.module = module
        self.keep_on = keep_on  # "auto" until the first adapter decides
        self.base: dict[str, torch.Tensor] = {}  # module name -> W0, taken before its first merge
        self.merged: set[str] = set()  # the layers holding W0 + (α/r)·B·A now
        self.adapter: LoraAdapter | None = None
        self._ahead = KeptAhead()  # host copies taken before the first adapter (keep_ahead)

    def keep_ahead(self, names) -> None:
        """Take the base copies of the layers `names` (those the run's adapters adapt) in a background thread where
        they go to pinned host memory, so the first adapter's fold does not wait for them. "auto" is decided now
        only when its answer is the host (the GPU's free memory only shrinks before the first adapter); a device
        copy is quick and still waits for the first adapter, as "auto" does. The weights do not change before the
        first `apply`, which waits for the thread."""
        names = list(names)
        if not names:
            return
        if self.keep_on == "auto" and self._auto_choice(names) == "host":
            self.keep_on = "host"
        if self.keep_on == "host":
            self._ahead.start(self._keep_all, names)

    def _keep_all(self, names: list[str]) -> None:
        for name in names:
            self._keep(name)

    def _wait_ahead(self) -> None:
        self._ahead.wait()

    def _check(self, layers: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Every layer exists, is a plain weight matrix and fits its A and B; nothing is changed before this
        passes."""
        modules = dict(self.module.named_modules())
        for name, (a, b) in layers.items():
            weight = getattr(modules.get(name), "weight", None)
            if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
                raise ValueError(f"LoRA layer {name!r}: the module has no such linear layer to merge into")
            out_features, in_features = weight.shape
            if a.dim() != 2 or b.dim() != 2 or a.shape[1] != in_features or b.shape[0] != out_features \
                    or a.shape[0] != b.shape[1]:
                raise ValueError(f"LoRA layer {name!r}: A {tuple(a.shape)} and B {tuple(b.shape)} do not fit its "
                                 f"weight {tuple(weight.shape)}")

    def _weight(self, name: str) -> torch.Tensor:
        return self.module.get_submodule(name).weight

    def _auto_choice(self, names) -> str:
        """What "auto" answers for the copies of the weights of `names`, by the GPU's free memory now."""
        weights = [self._weight(name) for name in names]
        copy_bytes = sum(w.numel() * w.element_size() for w in weights)
        device = weights[0].device
        return auto_keep_on(copy_bytes, torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None)

    def _choose_keep_on(self, names) -> None:
        """`keep_on="auto"`, decided for the weights of `names` (the first adapter's layers)."""
        self.keep_on = self._auto_choice(names)

    def _keep(self, name: str) -> torch.Tensor:
        if name not in self.base:
            weight = self._weight(name).detach()
            if self.keep_on == "host" and weight.device.type != "cpu":
                kept = torch.empty(weight.shape, dtype=weight.dtype, device="cpu", pin_memory=True)
                kept.copy_(weight)
            else:
                kept = weight.clone()
            self.base[name] = kept
        return self.base[name]

    @torch.no_grad()
    def apply(self, adapter: LoraAdapter | None) -> None:
        """Fold `adapter` in (None: the base model), replacing the adapter folded in before. An adapter that does
        not fit changes nothing; a failure halfway (out of memory) leaves the base model, never a mixture."""
        layers = adapter_layers(adapter) if adapter is not None else {}
        self._check(layers)
        self._wait_ahead()
        if self.keep_on == "auto" and layers:
            self._choose_keep_on(layers)
        try:
            for name in self.merged - layers.keys():  # layers the previous adapter adapted and this one does not
                self._weight(name).copy_(self.base[name], non_blocking=True)
            scale = adapter.alpha / adapter.rank if adapter is not None else 0.0
            for name, (a, b) in layers.items():
                weight = self._weight(name)
                weight.copy_(folded(self._keep(name), a, b, scale, weight.device))  # one rounding to its dtype
        except BaseException:
            for name, base in self.base.items():
                self._weight(name).copy_(base)
            self.merged, self.adapter = set(), None
            raise
        self.merged = set(layers)
        self.adapter = adapter

    @torch.no_grad()
    def load_base(self, named_tensors: dict[str, torch.Tensor]) -> list[str]:
        """New base weights ({transformer-relative name: tensor}) under the folded adapter: the kept copies of
        the layers they replace are dropped, the weights loaded, the adapter folded in again. Returns the names
        the module does not have (nothing is loaded then)."""
        unknown = sorted(set(named_tensors) - set(self.module.state_dict()))
        if unknown:
            return unknown
        self._wait_ahead()
        current = self.adapter
        self.apply(None)
        self.module.load_state_dict(named_tensors, strict=False)
        for key in named_tensors:
            self.base.pop(key.rpartition(".")[0], None)  # "<layer>.weight": that layer's W0 is the new one
        self.apply(current)
        return []
