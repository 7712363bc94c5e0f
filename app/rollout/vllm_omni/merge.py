"""A published LoRA folded into vllm-omni's weights (`rollout.merge_lora` with the vllm_omni engine): the generation
runs the base model's matmuls only, with no LoRA branch beside each adapted layer (vLLM's LoRA layers cost the
Qwen-Image rollout about a fifth of its speed with an r=64 adapter, docs/perf/vllm_omni/README.md).

vllm-omni's transformer fuses projections (to_q/k/v into one matrix, add_q/k/v_proj into another), so the fold is
done in the checkpoint's own (diffusers') names: W = W0 + (α/r)·B·A per adapted layer, computed in fp32 from W0 as the
checkpoint holds it (read from its files once, kept in host memory in the engine's dtype) and rounded once, then
written through the pipeline's weight loader, which packs each projection into its fused matrix as it did at
start-up. So versions never drift and the base model comes back bit for bit (the math of app/models/lora_merge.py,
which folds into a module's own Linears). Runs in vllm-omni's worker process (worker.py `merge_lora`).

The merged forward is not the trainer's unmerged one in bf16, so a run that merges takes its old log-probs from the
trainer (`train.old_logprob: trainer` or `recompute`), as with the in-process engines.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from app.models.lora import PIPELINE_PREFIX, targeted
from app.models.lora_merge import KeptAhead, folded


def _weight_map(folder: Path) -> dict[str, str]:
    """{tensor name: file} of a diffusers model folder (one safetensors file, or shards with their index)."""
    from safetensors import safe_open

    indexes = sorted(folder.glob("*.safetensors.index.json"))
    if indexes:
        return json.loads(indexes[0].read_text())["weight_map"]
    files = sorted(folder.glob("*.safetensors"))
    if len(files) != 1:
        raise FileNotFoundError(f"{folder}: expected one .safetensors file or an index, found {len(files)}")
    with safe_open(files[0], "pt") as f:
        return dict.fromkeys(f.keys(), files[0].name)


def checkpoint_layers(folder: str | Path, target_modules) -> list[str]:
    """The layers of a diffusers model folder whose weights a LoRA on `target_modules` adapts (peft's rule: the
    layer's name is a target or ends with "." and one)."""
    names = [key.removesuffix(".weight") for key in _weight_map(Path(folder)) if key.endswith(".weight")]
    return [n for n in names if targeted(n, target_modules)]


def checkpoint_shapes(folder: str | Path, names: list[str]) -> dict[str, tuple[int, ...]]:
    """The shapes of the tensors `names` of a diffusers model folder, read from the files' headers (no data)."""
    from safetensors import safe_open

    folder = Path(folder)
    where = _weight_map(folder)
    out = {}
    for file in sorted({where[n] for n in names}):
        with safe_open(folder / file, "pt") as f:
            for n in names:
                if where[n] == file:
                    out[n] = tuple(f.get_slice(n).get_shape())
    return out


def read_checkpoint_tensors(folder: str | Path, names: list[str]) -> dict[str, torch.Tensor]:
    """The tensors `names` of a diffusers model folder (one safetensors file, or shards with their index), on the
    CPU as stored; a KeyError names the first one it does not hold."""
    from safetensors import safe_open

    folder = Path(folder)
    where = _weight_map(folder)
    missing = [n for n in names if n not in where]
    if missing:
        raise KeyError(f"{folder} holds no tensor {missing[0]!r}")
    out = {}
    for file in sorted({where[n] for n in names}):
        with safe_open(folder / file, "pt") as f:
            for n in names:
                if where[n] == file:
                    out[n] = f.get_tensor(n)
    return out


class CheckpointMerge:
    """Folds one adapter at a time into a vllm-omni pipeline's transformer; `apply({}, 0)` is the base model again."""

    def __init__(self, load_weights, checkpoint: str | Path, *, dtype: torch.dtype, device: torch.device):
        """load_weights: the pipeline's loader of pipeline-named weights (worker.py `load_weights`)."""
        self.load_weights = load_weights
        self.folder = Path(checkpoint) / "transformer"
        self.dtype, self.device = dtype, device
        self.base: dict[str, torch.Tensor] = {}  # layer name -> W0 [out, in], host memory, the engine's dtype
        self.merged: set[str] = set()  # the layers holding W0 + (α/r)·B·A now
        self._ahead = KeptAhead()  # reading the base weights before the first adapter

    def keep_ahead(self, target_modules) -> int:
        """Read the base weights of every layer a LoRA on `target_modules` adapts into host memory in a background
        thread, so that the first fold waits for nothing (27 GB for Qwen-Image's 12 targets: about 27 s on an H100
        host); returns how many layers. The first `apply` waits for the thread."""
        names = checkpoint_layers(self.folder, target_modules)
        if names:
            self._ahead.start(self._keep, names)
        return len(names)

    def _keep(self, names) -> None:
        new = [n for n in names if n not in self.base]
        if not new:
            return
        read = read_checkpoint_tensors(self.folder, [f"{n}.weight" for n in new])
        pin = self.device.type == "cuda"
        for name in new:
            tensor = read[f"{name}.weight"].to(self.dtype)
            self.base[name] = tensor.pin_memory() if pin else tensor

    def _check(self, layers: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Every layer is a weight matrix of the checkpoint that its A and B fit: nothing changes before this."""
        try:
            self._keep(layers)
        except KeyError as err:
            raise ValueError(f"LoRA layer not in the checkpoint: {err}") from None
        for name, (a, b) in layers.items():
            weight = self.base[name]
            if weight.dim() != 2 or a.dim() != 2 or b.dim() != 2 or a.shape[1] != weight.shape[1] \
                    or b.shape[0] != weight.shape[0] or a.shape[0] != b.shape[1]:
                raise ValueError(f"LoRA layer {name!r}: A {tuple(a.shape)} and B {tuple(b.shape)} do not fit its "
                                 f"weight {tuple(weight.shape)}")

    def _load(self, named: dict[str, object]) -> None:
        """Load {layer: producer of its weight} one layer at a time (a merged copy of every adapted weight at once
        would double the transformer's memory); each must reach a parameter."""
        def weights():
            for name, make in named.items():
                yield f"{PIPELINE_PREFIX}{name}.weight", make()

        loaded = self.load_weights(weights())
        lost = [n for n in named if f"{PIPELINE_PREFIX}{n}.weight" not in loaded]
        if lost:
            raise RuntimeError(f"vllm-omni's weight loader took no parameter for {lost[0]!r} ({len(lost)} layers; "
                               f"it loaded {sorted(loaded)[:4]})")

    @torch.no_grad()
    def apply(self, layers: dict[str, tuple[torch.Tensor, torch.Tensor]], scale: float) -> int:
        """Fold the adapter {layer: (A [r, in], B [out, r])} in at `scale` = α/r ({}: the base model), replacing the
        one folded in before; returns how many layers hold an adapter. A failure halfway leaves the base model."""
        self._ahead.wait()
        self._check(layers)

        def restored(name):
            return lambda: self.base[name].to(self.device, non_blocking=True)

        def merged(name, a, b):  # one rounding to the engine's dtype
            return lambda: folded(self.base[name], a, b, scale, self.device).to(self.dtype)

        named = {name: restored(name) for name in self.merged - layers.keys()}
        named.update({name: merged(name, a, b) for name, (a, b) in layers.items()})
        try:
            self._load(named)
        except BaseException:
            self._load({name: restored(name) for name in self.base})
            self.merged = set()
            raise
        self.merged = set(layers)
        return len(self.merged)
