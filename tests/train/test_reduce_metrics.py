"""The step's metrics combined over the training workers (`app.metrics.reduce_over_workers`): means, extremes and
sums, right even when the ranks report different keys (a mismatched all-reduce would hang NCCL). Gloo ranks on the
CPU against the same combination worked out in plain Python."""

import math

import pytest
import torch.multiprocessing as mp
from gloo import free_port


def rank_metrics(rank: int) -> dict[str, float]:
    """What rank `rank` reports: keys every rank has, and keys only some ranks have."""
    out = {"loss": 1.5 * rank - 0.25, "timing/wait_s_max": 0.1 * rank + 0.3, "clip_min": 2.0 - rank,
           "images_sum": 8.0 + rank}
    if rank % 2 == 1:  # only the odd ranks: one key of each kind
        out.update({"odd_mean": 10.0 * rank, "odd_max": -float(rank), "odd_min": float(rank), "odd_sum": 3.0})
    if rank == 0:
        out["only_zero"] = 7.0
    return out


def expected(world: int) -> dict[str, float]:
    """The combination in plain Python: each key over the ranks that report it."""
    reports = [rank_metrics(r) for r in range(world)]
    out = {}
    for key in set().union(*reports):
        values = [m[key] for m in reports if key in m]
        if key.endswith("_max"):
            out[key] = max(values)
        elif key.endswith("_min"):
            out[key] = min(values)
        elif key.endswith("_sum"):
            out[key.removesuffix("_sum")] = math.fsum(values)
        else:
            out[key] = math.fsum(values) / len(values)
    return out


def _rank(rank: int, world: int, port: int, results) -> None:
    import torch.distributed as dist

    from app.metrics import reduce_over_workers

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        results.put((rank, reduce_over_workers(rank_metrics(rank), world)))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # fresh processes (a gloo group of spawned ranks)
@pytest.mark.parametrize("world", [1, 2, 3])
def test_every_rank_gets_each_key_combined_over_the_ranks_that_report_it(world):
    results = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_rank, args=(world, free_port(), results), nprocs=world, join=True)
    got = dict(results.get() for _ in range(world))
    want = expected(world)
    for rank in range(world):
        assert got[rank].keys() == want.keys(), rank
        for key, value in want.items():
            assert got[rank][key] == pytest.approx(value, rel=1e-15, abs=1e-15), (rank, key)
