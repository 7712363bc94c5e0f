"""The process group of a bench: torchrun's world when torchrun started the process, else a world of one."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


def init_world() -> tuple[int, int, torch.device]:
    """(rank, world size, device): NCCL on this rank's GPU (torchrun's LOCAL_RANK) when there is one, else gloo on
    the CPU."""
    cuda = torch.cuda.is_available()
    backend = "nccl" if cuda else "gloo"
    if "WORLD_SIZE" in os.environ:  # torchrun
        local = int(os.environ["LOCAL_RANK"])
        if cuda:
            torch.cuda.set_device(local)
        dist.init_process_group(backend)
        return dist.get_rank(), dist.get_world_size(), torch.device("cuda", local) if cuda else torch.device("cpu")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:  # a free one: a fixed port can be taken by another process (Ray's)
        from torch.distributed.elastic.utils.distributed import get_free_port

        os.environ["MASTER_PORT"] = str(get_free_port())
    dist.init_process_group(backend, rank=0, world_size=1)
    return 0, 1, torch.device("cuda", 0) if cuda else torch.device("cpu")
