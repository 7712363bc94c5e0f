"""The LoRA's way from the trainer's GPUs to the host, where it is published and checkpointed: only the adapter
parameters are gathered (never the base model), all of them in one collective. Plain torch (the benchmark
`jobs.bench_export` runs it without the rest of the trainer)."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor on every rank (a collective for an FSDP2 DTensor shard)."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def _row_shard(tensor: torch.Tensor):
    """(mesh, rows, rows per rank) of an FSDP2 shard (`Shard(0)` on a 1-D mesh) whose local rows are where
    `torch.chunk` puts them; None for anything else."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(tensor, DTensor) or tensor.device_mesh.ndim != 1 or tuple(tensor.placements) != (Shard(0),):
        return None
    mesh, rows = tensor.device_mesh, tensor.shape[0]
    chunk = -(-rows // mesh.size())
    start = min(mesh.get_local_rank() * chunk, rows)
    if tensor.to_local().shape[0] != min(start + chunk, rows) - start:
        return None
    return mesh, rows, chunk


def gather_full(tensors: list[torch.Tensor], dtype: torch.dtype | None = None) -> list[torch.Tensor]:
    """The whole tensors (in `dtype` if given), FSDP2's row shards gathered in one all-gather: each rank's shards,
    cast and padded to the same rows per rank, travel as one buffer (one DTensor gather per tensor was a
    collective launch each: 1,440 of them for a 20B model's LoRA). Every rank must call it."""
    out: list[torch.Tensor | None] = [None] * len(tensors)
    mesh, shards = None, {}  # the mesh of the first row shard; {index: (rows, rows per rank)} of those on it
    for k, tensor in enumerate(tensors):
        shard = _row_shard(tensor)
        if shard is None or (mesh is not None and shard[0] is not mesh):
            out[k] = full_tensor(tensor).to(dtype or tensor.dtype)
        else:
            mesh, shards[k] = shard[0], shard[1:]
    if shards:
        pieces, sizes = [], []
        for k, (_, chunk) in shards.items():
            local = tensors[k].to_local().to(dtype or tensors[k].dtype).reshape(-1)
            size = chunk * math.prod(tensors[k].shape[1:])
            pieces += [local, local.new_zeros(size - local.numel())]  # padding: the rows this rank lacks
            sizes.append(size)
        send = torch.cat(pieces)
        received = send.new_empty(mesh.size() * send.numel())
        dist.all_gather_into_tensor(received, send, group=mesh.get_group())
        by_rank, offset = received.view(mesh.size(), -1), 0
        for (k, (rows, chunk)), size in zip(shards.items(), sizes, strict=True):
            shape = tensors[k].shape
            out[k] = by_rank[:, offset:offset + size].reshape(mesh.size() * chunk, *shape[1:])[:rows]
            offset += size
    return out


def to_host(params: list[tuple[str, torch.Tensor]], dtype: torch.dtype | None,
            pinned: bool = True) -> dict[str, torch.Tensor]:
    """{name: the whole parameter on the host, in `dtype` if given}. Cast, the tensors cross in one copy of one
    flat device buffer (the host tensors are views of it), into page-locked memory when `pinned` and on a GPU
    (torch's host allocator keeps the block for the next step's copy once this adapter is dropped; into fresh
    pageable memory the 810 MB of a 20B model's LoRA took longer than the fp32 copies: jobs.bench_export); as they
    are (a checkpoint's fp32), one copy each (measured faster there)."""
    full = gather_full([p.detach() for _, p in params], dtype)
    if not full:
        return {}
    if dtype is None or len({t.dtype for t in full}) > 1:
        return {name: t.to("cpu", copy=True) for (name, _), t in zip(params, full, strict=True)}
    flat = torch.empty(sum(t.numel() for t in full), dtype=dtype, device=full[0].device)
    offset = 0
    for tensor in full:
        flat[offset:offset + tensor.numel()].copy_(tensor.reshape(-1))
        offset += tensor.numel()
    shapes = [t.shape for t in full]
    del full
    host = torch.empty(flat.shape, dtype=dtype, pin_memory=pinned and flat.is_cuda)
    host.copy_(flat)
    out, offset = {}, 0
    for (name, _), shape in zip(params, shapes, strict=True):
        out[name] = host[offset:offset + shape.numel()].view(shape)
        offset += shape.numel()
    return out
