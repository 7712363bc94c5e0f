"""The LoRA's way out of the trainer: from FSDP2 shards on the GPUs to one adapter on the host, as every step's
publication (and every checkpoint) starts. Run on every GPU of the trainer:

    torchrun --nproc_per_node=2 -m jobs.bench_export [--layers 60] [--rank 64] [--repeats 5]

The adapter has the shapes of the `qwen_image_ocr_2gpu` recipe (r=64 on the 12 attention + MLP targets of each of
Qwen-Image's 60 blocks: 1,440 tensors, 425M fp32 parameters), sharded as FSDP2 shards them (`Shard(0)` on a
1-D mesh of the ranks), random values. Side by side, the same tensors each time:

- `each`: gather a tensor (`DTensor.full_tensor`), copy it to the host, next (the trainer until 2026-11-26);
- `queued`: every `full_tensor` queued, then one host copy per tensor (`queued_bf16`: each cast on the way);
- `gathered`: `app.train.gather.to_host` as a checkpoint calls it (fp32): one all-gather of every shard, one host
  copy per tensor;
- `gathered_bf16`: `to_host` as a step publishes (cast to the replicas' bf16 before the all-gather): one
  all-gather, one device buffer, one host copy into pinned memory (`gathered_bf16_pageable`: into fresh pageable
  memory, as until 2026-11-27).

Prints one JSON line (rank 0): the median seconds of each over --repeats, and the bytes each brings to the host.
Plain torch and NCCL: no Ray, no model.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist

from app.train.gather import full_tensor, to_host
from jobs.world import init_world

ATTENTION = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"]
MLP = {"img_mlp.net.0.proj": (1, 4), "img_mlp.net.2": (4, 1), "txt_mlp.net.0.proj": (1, 4), "txt_mlp.net.2": (4, 1)}


def recipe_shapes(layers: int, rank: int, dim: int = 3072) -> dict[str, tuple[int, int]]:
    """{tensor name: shape} of the recipe's LoRA (A: [r, in], B: [out, r]), as `Policy.export_adapter` names them."""
    shapes = {f"attn.{t}": (dim, dim) for t in ATTENTION} | {t: (dim * i, dim * o) for t, (i, o) in MLP.items()}
    out = {}
    for block in range(layers):
        for target, (fan_in, fan_out) in shapes.items():
            out[f"transformer_blocks.{block}.{target}.lora_A.weight"] = (rank, fan_in)
            out[f"transformer_blocks.{block}.{target}.lora_B.weight"] = (fan_out, rank)
    return out


def each(params, dtype):
    return {name: full_tensor(p).to("cpu", copy=True) for name, p in params}


def queued(params, dtype):
    full = [full_tensor(p) for _, p in params]
    return {name: t.to("cpu", dtype=dtype, copy=True) for (name, _), t in zip(params, full, strict=True)}


def pageable(params, dtype):
    return to_host(params, dtype, pinned=False)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=60)
    parser.add_argument("--rank", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    _, world, device = init_world()
    cuda = device.type == "cuda"
    mesh = init_device_mesh(device.type, (world,))
    generator = torch.Generator().manual_seed(0)  # the same full tensors on every rank: each keeps its shard
    params = [(name, distribute_tensor(torch.randn(shape, generator=generator).to(device), mesh, [Shard(0)]))
              for name, shape in recipe_shapes(args.layers, args.rank).items()]

    paths = {"each": (each, None), "queued": (queued, None), "queued_bf16": (queued, torch.bfloat16),
             "gathered": (to_host, None), "gathered_bf16": (to_host, torch.bfloat16),
             "gathered_bf16_pageable": (pageable, torch.bfloat16)}
    seconds = {name: [] for name in paths}
    host_bytes = {}
    for repeat in range(args.repeats + 1):  # the first round warms NCCL and the allocator up
        for name, (path, dtype) in paths.items():
            dist.barrier()
            if cuda:
                torch.cuda.synchronize()
            started = time.perf_counter()
            out = path(params, dtype)
            elapsed = time.perf_counter() - started
            if repeat:
                seconds[name].append(elapsed)
            host_bytes[name] = sum(t.numel() * t.element_size() for t in out.values())
            del out
    if dist.get_rank() == 0:
        print(json.dumps({"bench": "export", "ranks": world, "device": torch.cuda.get_device_name() if cuda else "cpu",
                          "tensors": len(params), "parameters": sum(p.numel() for _, p in params),
                          **{f"{name}_s": round(statistics.median(v), 4) for name, v in seconds.items()},
                          **{f"{name}_host_mb": round(b / 2**20, 1) for name, b in host_bytes.items()}}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
