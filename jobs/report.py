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


@contextmanager
def profiled():
    """`with profiled() as out:` runs the block under torch's profiler (the GPU's kernels, or the CPU's without one);
    after it, `out["seconds"]` is its wall time, the GPU drained, and `out["kernels"]` its `kernel_time_by_kind`."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    out: dict = {}
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        began = time.perf_counter()
        yield out
        if cuda:
            torch.cuda.synchronize()
        out["seconds"] = time.perf_counter() - began
    out["kernels"] = kernel_time_by_kind(prof)
