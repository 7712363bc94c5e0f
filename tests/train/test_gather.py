"""The LoRA's way to the host (`app.train.gather`): FSDP2's row shards gathered in one collective give exactly the
tensors `DTensor.full_tensor` gives, for shapes that do not divide over the ranks (a rank with fewer rows, or none)
and for tensors that are not row shards; cast on the way when asked. Two and three gloo ranks on the CPU."""

import pytest
import torch
import torch.multiprocessing as mp
from gloo import free_port

SHAPES = [(3, 5), (4, 2), (1, 7), (64, 3), (5,), (2, 3, 4)]


def _rank(rank: int, world: int, port: int, failures) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from app.train.gather import gather_full, to_host

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        generator = torch.Generator().manual_seed(0)
        whole = [torch.randn(shape, generator=generator, dtype=torch.float64).float() for shape in SHAPES]
        tensors = [distribute_tensor(t, mesh, [Shard(0)]) for t in whole]
        tensors += [distribute_tensor(whole[0], mesh, [Replicate()]), whole[1]]  # not row shards: as they are
        expected = [*whole, whole[0], whole[1]]
        for got, want in zip(gather_full(tensors), expected, strict=True):
            assert got.shape == want.shape and torch.equal(got, want), (got.shape, want.shape)
        for got, want in zip(gather_full(tensors, torch.bfloat16), expected, strict=True):
            assert got.dtype == torch.bfloat16 and torch.equal(got, want.to(torch.bfloat16))
        named = [(f"t{k}", t) for k, t in enumerate(tensors)]
        for dtype, pinned in [(None, True), (torch.bfloat16, True), (torch.bfloat16, False)]:
            host = to_host(named, dtype, pinned=pinned)  # pinned: on a GPU only (the same values)
            for k, want in enumerate(expected):
                assert host[f"t{k}"].device.type == "cpu"
                assert torch.equal(host[f"t{k}"], want.to(dtype or want.dtype)), (k, dtype)
    except AssertionError as e:
        failures.put(f"rank {rank} of {world}: {e!r}")
        raise
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # fresh processes (a gloo group of spawned ranks)
@pytest.mark.parametrize("world", [2, 3])
def test_row_shards_gathered_at_once_equal_full_tensor(world):
    failures = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_rank, args=(world, free_port(), failures), nprocs=world, join=True)
    assert failures.empty()
