"""LoRA publication: from the trainer's exported adapter to every rollout replica holding it on its device.

    python -m jobs.bench_publish [--layers 60] [--rank 64] [--replicas 2] [--repeats 3]
    python -m jobs.bench_publish --swap [--layers 60] [--rank 64] [--repeats 3]

The adapter has the shapes of the `qwen_image_ocr_2gpu` recipe (r=64 on the 12 attention + MLP targets of each of
Qwen-Image's 60 blocks: 425M parameters), random values. The path is the application's: the trainer's
`publish_lora` packs it (`LoraAdapter.packed`: one buffer in the replicas' dtype), the adapter store
(`deployments.adapters.AdapterStore`, here a plain Ray actor) keeps it in the object store, and each replica reads
it and unpacks it onto its device (the GPU when there is one) as `RolloutReplica.load_lora` does, minus the engine's
own copy into its LoRA weights. The comparison is the previous transport: the dict of fp32 torch tensors, pickled.
Prints one JSON line: seconds (median of --repeats) of each path, and the bytes moved.

`--swap` times the engine's own last part instead, the pause between two groups while an in-process engine swaps a
published adapter in (`LocalEngine._apply_staged`), on a Qwen-Image transformer of `--layers` blocks (real width,
bf16, on the GPU when there is one; weights uninitialised: a copy does not look at values): the first adapter
(peft creates the LoRA modules), a later version through peft's `set_peft_model_state_dict`, and a later version
by `copy_into_lora` (one fused copy into the existing parameters, what the engines do).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time

import ray
import torch

from app.types import LoraAdapter, PackedLora
from deployments.adapters import AdapterStore
from jobs.bench_export import ATTENTION, MLP, recipe_shapes
from jobs.report import emit_json_line


def recipe_adapter(layers: int, rank: int, dim: int = 3072) -> LoraAdapter:
    """Random LoRA tensors with the recipe's names and shapes (A: [r, in], B: [out, r]), fp32 as exported."""
    tensors = {name: torch.randn(shape) * 0.01 for name, shape in recipe_shapes(layers, rank, dim).items()}
    return LoraAdapter(tensors, rank=rank, alpha=2 * rank, target_modules=ATTENTION + list(MLP), version=1)


@ray.remote
class Replica:
    """What a rollout replica does with a published adapter, up to the engine."""

    def __init__(self):
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    async def load(self, refs: list) -> int:
        (ref,) = refs
        adapter = await ref
        if isinstance(adapter, PackedLora):
            adapter = adapter.unpack(self.device)
        else:  # the previous transport: tensor by tensor
            adapter.tensors = {k: v.to(self.device) for k, v in adapter.tensors.items()}
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        return adapter.version


async def publish_once(store, replicas, adapter: LoraAdapter, dtype: torch.dtype | None) -> dict[str, float]:
    began = time.perf_counter()
    payload = adapter.packed(dtype) if dtype is not None else adapter
    packed = time.perf_counter()
    version, refs = await store.publish.remote(payload)
    stored = time.perf_counter()
    assert await asyncio.gather(*[r.load.remote(refs) for r in replicas]) == [version] * len(replicas)
    done = time.perf_counter()
    return {"pack_s": packed - began, "store_s": stored - packed, "replicas_s": done - stored, "total_s": done - began}


async def bench(layers: int, rank: int, replicas: int, repeats: int) -> dict:
    store = ray.remote(AdapterStore).options(num_cpus=0).remote()
    receivers = [Replica.options(num_cpus=0, num_gpus=(1 / replicas if torch.cuda.is_available() else 0)).remote()
                 for _ in range(replicas)]
    adapter = recipe_adapter(layers, rank)
    parameters = sum(v.numel() for v in adapter.tensors.values())
    serving = torch.bfloat16
    out = {"bench": "publish", "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
           "parameters": parameters, "replicas": replicas, "tensors": len(adapter.tensors)}
    for label, dtype, nbytes in [("packed_bf16", serving, parameters * 2), ("tensor_dict_fp32", None, parameters * 4)]:
        runs = [await publish_once(store, receivers, adapter, dtype) for _ in range(repeats + 1)][1:]  # warm-up
        out[label] = {k: round(statistics.median(r[k] for r in runs), 3) for k in runs[0]} | {"bytes": nbytes}
    return out


def bench_swap(layers: int, rank: int, repeats: int) -> dict:
    from diffusers import QwenImageTransformer2DModel

    from app.models.lora import attach_lora, copy_into_lora
    from app.models.qwen_image.real_size import TRANSFORMER

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    with torch.device("meta"):
        transformer = QwenImageTransformer2DModel(**{**TRANSFORMER, "num_layers": layers})
    transformer = transformer.to_empty(device=device).to(torch.bfloat16)
    versions = []
    for version in (1, 2):  # as a replica holds them: unpacked onto its device in the serving dtype
        adapter = recipe_adapter(layers, rank)
        adapter.tensors = {k: v.to(device, torch.bfloat16) for k, v in adapter.tensors.items()}
        adapter.version = version
        versions.append(adapter)

    def timed(swap) -> float:
        if cuda:
            torch.cuda.synchronize()
        began = time.perf_counter()
        swap()
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - began

    def fused_swap(adapter):
        if not copy_into_lora(transformer, adapter):
            raise RuntimeError("copy_into_lora refused an adapter of the same rank and targets")

    first = timed(lambda: attach_lora(transformer, versions[0]))
    peft = [timed(lambda v=v: attach_lora(transformer, versions[v % 2])) for v in range(1, repeats + 1)]
    fused = [timed(lambda v=v: fused_swap(versions[v % 2])) for v in range(1, repeats + 1)]
    return {"bench": "adapter_swap", "device": torch.cuda.get_device_name() if cuda else "cpu", "layers": layers,
            "parameters": sum(v.numel() for v in versions[0].tensors.values()),
            "tensors": len(versions[0].tensors), "first_attach_s": round(first, 3),
            "peft_set_state_dict_s": round(statistics.median(peft), 4),
            "fused_copy_s": round(statistics.median(fused), 4)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=60)
    parser.add_argument("--rank", type=int, default=64)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--swap", action="store_true", help="time the engine's adapter swap instead (no Ray)")
    args = parser.parse_args(argv)
    if args.swap:
        emit_json_line(bench_swap(args.layers, args.rank, args.repeats))
        return 0
    ray.init(include_dashboard=False, log_to_driver=False)
    emit_json_line(asyncio.run(bench(args.layers, args.rank, args.replicas, args.repeats)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
