"""The profiles' idle analysis (jobs/report.py): where a profiled block's GPU waited, and what the host ran then,
against brute-force references."""

import random

from jobs.report import host_time_in_gaps, idle_gaps


def _idle_by_grid(busy, window, shortest):
    """The uncovered stretches of `window`, from a grid of integer microseconds."""
    covered = [any(a <= t < b for a, b in busy) for t in range(window[0], window[1])]
    gaps, start = [], None
    for t, c in enumerate(covered + [True]):
        if not c and start is None:
            start = t
        if c and start is not None:
            if t - start > shortest:
                gaps.append((window[0] + start, window[0] + t))
            start = None
    return gaps


def test_idle_gaps_are_the_window_no_kernel_covers():
    assert idle_gaps([(0, 5), (3, 8), (12, 20), (15, 18), (25, 30)], (0, 30)) == [(8, 12), (20, 25)]
    assert idle_gaps([(0, 5), (12, 20)], (0, 30), shortest=8) == [(20, 30)]  # 7 us left out, the tail kept
    rng = random.Random(0)
    for _ in range(200):
        busy = [(s, s + rng.randint(1, 15)) for s in (rng.randint(0, 190) for _ in range(rng.randint(0, 25)))]
        shortest = rng.choice([0, 2, 5])
        assert idle_gaps(busy, (0, 200), shortest) == _idle_by_grid(busy, (0, 200), shortest), busy


def _nested_ops(rng, thread, start, end, depth=0):
    """Operations nested as one thread's profiler records them."""
    ops, t = [], start
    while t < end - 2 and depth < 4:
        a = rng.randint(t, end - 2)
        b = rng.randint(a + 1, end)
        shift = thread / 100  # no two threads' operations begin at once (which would be a tie)
        ops.append((f"op{thread}.{depth}.{a}", a + shift, b + shift, thread))
        ops += _nested_ops(rng, thread, a, b, depth + 1)
        t = b + rng.randint(0, 5)
    return ops


def _innermost_by_scan(gaps, ops):
    spent = {}
    for a, b in gaps:
        # the latest start, then the earliest end; of equal intervals the deeper (recorded later)
        running = [(op[1], -op[2], i, op[0]) for i, op in enumerate(ops) if op[1] <= (a + b) / 2 < op[2]]
        name = max(running)[3] if running else "(none)"
        spent[name] = spent.get(name, 0) + b - a
    return spent


def test_host_time_in_gaps_goes_to_the_innermost_operation_that_began_last():
    ops = [("step", 0, 100, 1), ("sync", 10, 30, 1), ("backward", 0, 100, 2), ("mm", 40, 60, 2), ("launch", 70, 71, 1)]
    gaps = [(12, 28), (45, 55), (80, 90), (101, 103)]
    assert host_time_in_gaps(gaps, ops) == {"sync": 16, "mm": 10, "step": 10, "(none)": 2}
    rng = random.Random(1)
    for _ in range(100):
        ops = [op for thread in (1, 2, 3) for op in _nested_ops(rng, thread, 0, 300)]
        gaps = sorted((a, a + rng.randint(1, 9)) for a in rng.sample(range(0, 300, 10), 12))
        assert host_time_in_gaps(gaps, ops, top=100) == _innermost_by_scan(gaps, ops)


def test_gpu_idle_reads_the_profilers_events():
    """gpu_idle on torch's own event records (a GPU's kernels and a host's operations, as a profile of a GPU
    holds them; this machine has no GPU to profile)."""
    from torch.autograd import DeviceType
    from torch.autograd.profiler_util import EventList, FunctionEvent

    from jobs.report import gpu_idle

    def event(i, name, start, end, device):
        return FunctionEvent(i, name, thread=7, start_us=start, end_us=end, device_type=device)

    class Profile:
        def events(self):
            return EventList([event(0, "step", 0, 1000, DeviceType.CPU),
                              event(1, "aten::item", 300, 600, DeviceType.CPU),
                              event(2, "gemm", 100, 300, DeviceType.CUDA), event(3, "gemm", 620, 900, DeviceType.CUDA),
                              event(4, "add", 900, 930, DeviceType.CUDA)])

    assert gpu_idle(Profile()) == {"gpu_idle_s": 0.00032, "gpu_idle_gaps": 1,
                                   "gpu_idle_by_host_op": {"aten::item": 0.00032}}
