"""Machine-readable output of the jobs."""

import json
import os
import sys
import time
from contextlib import contextmanager


def emit_json_line(result: dict) -> None:
    """One JSON line on stdout, written to fd 1 directly: vllm decorates `sys.stdout.write` with a
    "(DiffusionWorker pid=…)" prefix in the process that runs an engine."""
    sys.stdout.flush()
    os.write(1, (json.dumps(result) + "\n").encode())


KERNEL_KINDS = [  # (kind, substrings of CUDA kernel names), first match wins
    ("attention", ("flash", "fmha", "attention", "sdpa")),
    ("matmul", ("gemm", "cutlass", "xmma", "sm90", "wgmma", "cublas")),
    ("collective_copy", ("nccl", "memcpy", "memset", "copy_kernel", "catarraybatched", "split_with_sizes")),
    ("reduction_norm", ("reduce", "norm", "softmax")),
]


def kernel_time_by_kind(profiler) -> dict:
    """GPU seconds per kind of kernel (element-wise: whatever is not named above), and the top kernels."""
    kernels = [e for e in profiler.key_averages() if e.device_type.name == "CUDA" and e.self_device_time_total > 0]
    by_kind: dict[str, float] = {}
    for event in kernels:
        name = event.key.lower()
        kind = next((k for k, words in KERNEL_KINDS if any(w in name for w in words)), "elementwise")
        by_kind[kind] = by_kind.get(kind, 0.0) + event.self_device_time_total / 1e6
    top = sorted(kernels, key=lambda e: -e.self_device_time_total)[:25]
    return {"gpu_s_by_kind": {k: round(v, 3) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
            "gpu_s_total": round(sum(by_kind.values()), 3),
            "top_kernels": [{"name": e.key[:120], "gpu_s": round(e.self_device_time_total / 1e6, 4),
                             "calls": e.count} for e in top]}


def idle_gaps(busy: list[tuple[float, float]], window: tuple[float, float],
              shortest: float = 0.0) -> list[tuple[float, float]]:
    """The stretches of `window` that no interval of `busy` covers (intervals may overlap: streams), longer than
    `shortest`, in order."""
    gaps, reached = [], window[0]
    for start, end in sorted(busy):
        if start > reached and start - reached > shortest:
            gaps.append((reached, min(start, window[1])))
        reached = max(reached, end)
        if reached >= window[1]:
            break
    if window[1] - reached > shortest:
        gaps.append((reached, window[1]))
    return [g for g in gaps if g[1] > g[0]]


def host_time_in_gaps(gaps: list[tuple[float, float]], ops: list[tuple[str, float, float, int]],
                      top: int = 12) -> dict[str, float]:
    """Each gap's length given to the innermost host operation running at its middle: `ops` are (name, start, end,
    thread), nested within a thread as a profiler records them; of the threads' innermost running operations the
    one that began last ("(none)": no recorded operation ran). What the host was doing while the GPU waited."""
    stacks: dict[int, list[tuple[str, float, float, int]]] = {}
    ordered, i, spent = sorted(ops, key=lambda op: (op[1], -op[2])), 0, {}
    for start, end in sorted(gaps):
        middle = (start + end) / 2
        while i < len(ordered) and ordered[i][1] <= middle:
            op, i = ordered[i], i + 1
            stack = stacks.setdefault(op[3], [])
            while stack and stack[-1][2] <= op[1]:  # ended before this one began: not its parent
                stack.pop()
            stack.append(op)
        innermost = None
        for stack in stacks.values():
            while stack and stack[-1][2] <= middle:
                stack.pop()
            if stack and (innermost is None or stack[-1][1] > innermost[1]):
                innermost = stack[-1]
        name = innermost[0] if innermost else "(none)"
        spent[name] = spent.get(name, 0.0) + (end - start)
    return dict(sorted(spent.items(), key=lambda kv: -kv[1])[:top])


def gpu_idle(profiler, shortest_us: float = 50.0) -> dict:
    """Where the GPU waited in a profiled block: its idle seconds between the first and the last kernel, in gaps
    longer than `shortest_us`, and the host operations running in them (launch-bound code, synchronisations)."""
    events = profiler.events()
    kernels = [(e.time_range.start, e.time_range.end) for e in events
               if e.device_type.name == "CUDA" and e.time_range.end > e.time_range.start]
    if not kernels:
        return {}
    window = (min(k[0] for k in kernels), max(k[1] for k in kernels))
    gaps = idle_gaps(kernels, window, shortest_us)
    ops = [(e.name, e.time_range.start, e.time_range.end, e.thread) for e in events if e.device_type.name == "CPU"]
    return {"gpu_idle_s": round(sum(b - a for a, b in gaps) / 1e6, 6), "gpu_idle_gaps": len(gaps),
            "gpu_idle_by_host_op": {name: round(us / 1e6, 6) for name, us in host_time_in_gaps(gaps, ops).items()}}


@contextmanager
def profiled():
    """`with profiled() as out:` runs the block under torch's profiler (the GPU's kernels and the host's operations,
    or the CPU's alone without a GPU); after it, `out["seconds"]` is its wall time, the GPU drained,
    `out["kernels"]` its `kernel_time_by_kind` and, on a GPU, `gpu_idle`'s figures, and `out["gpu_busy"]` the share
    of the wall time the GPU worked (None without a GPU)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    out: dict = {}
    with profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]) as prof:
        began = time.perf_counter()
        yield out
        if cuda:
            torch.cuda.synchronize()
        out["seconds"] = time.perf_counter() - began
    out["kernels"] = kernel_time_by_kind(prof)
    out["gpu_busy"] = round(out["kernels"]["gpu_s_total"] / out["seconds"], 3) if cuda else None
    if cuda:
        try:  # a report only: a profiler that keeps other fields must not cost the bench its line
            out["kernels"].update(gpu_idle(prof))
        except Exception as err:
            out["kernels"]["gpu_idle_error"] = repr(err)[:200]
