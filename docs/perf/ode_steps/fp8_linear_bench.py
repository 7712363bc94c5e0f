"""Where FP8 ODE steps lose their speed: one linear layer at a real block's shapes, compiled, each way.

Z-Image's FP8 ODE steps ran 1.09x the model's precision on one H100 (lease 11), five of six steps in FP8; matmuls
near half a step's time in bf16 would allow more. This times, per shape, CUDA events around 20 calls after a warm-up:

- `bf16`: `F.linear` at the model's dtype (the reference);
- `fp8_rowwise`: the project's layer (`app.rollout.ode_steps.fp8_linear_forward`: the activations quantized per row,
  the weights per channel, `torch._scaled_mm`), quantization included;
- `fp8_rowwise_mm`: its GEMM alone, the activations quantized beforehand (what the quantization costs);
- `fp8_rowwise_fast`: the same with `use_fast_accum=True` (Hopper's faster FP8 accumulation, torchao's forward);
- `fp8_tensorwise`: one scale for the activations and one for the weight (cuBLASLt's kernel), quantization included;
- `fp8_tensorwise_fast`: that with fast accumulation.

Every FP8 way but the GEMM alone is the project's layer set as `rollout.ode_steps.fp8_scaling` / `fp8_fast_accum` set it.

Prints one JSON line per shape: milliseconds and TFLOP/s of each, and each one's speed-up over bf16.

    python docs/perf/ode_steps/fp8_linear_bench.py [--tokens 17600]   # a CPU dry run: --tokens 64 --repeats 1
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import time

import torch
import torch.nn.functional as F

from app.rollout.ode_steps import _quantize_weight, fp8_linear_forward, quantize

# (name, in, out): the blocks' linear layers of Z-Image (dim 3840, SwiGLU 10240) and Qwen-Image (3072, GELU 12288)
SHAPES = [("z_image.attn", 3840, 3840), ("z_image.ffn_up", 3840, 10240), ("z_image.ffn_down", 10240, 3840),
          ("qwen_image.attn", 3072, 3072), ("qwen_image.mlp_up", 3072, 12288), ("qwen_image.mlp_down", 12288, 3072)]
# FP8's ways through the project's layer: (scaling, fast accumulation), as `rollout.ode_steps` sets them
FP8_WAYS = {"fp8_rowwise": ("rowwise", False), "fp8_rowwise_fast": ("rowwise", True),
            "fp8_tensorwise": ("tensorwise", False), "fp8_tensorwise_fast": ("tensorwise", True)}


def ways(layer: torch.nn.Linear):
    """{way: (function, its arguments' maker)}: bf16, each FP8 way on a copy of the layer quantized its way, and the
    rowwise GEMM alone on activations quantized beforehand."""
    found = {"bf16": (lambda x: F.linear(x, layer.weight), lambda x: (x,))}
    for way, (scaling, fast) in FP8_WAYS.items():
        fp8 = copy.deepcopy(layer)
        _quantize_weight(fp8, scaling, fast)
        found[way] = (functools.partial(fp8_linear_forward, fp8), lambda x: (x,))
    rowwise = found["fp8_rowwise"][0].args[0]

    def gemm(q, scale):
        return torch._scaled_mm(q, rowwise._ode_fp8_weight.t(), scale_a=scale, scale_b=rowwise._ode_fp8_scale,
                                out_dtype=torch.bfloat16)

    found["fp8_rowwise_mm"] = (gemm, quantize)
    return found


def time_ms(fn, args, repeats: int = 20) -> float:
    for _ in range(3):
        fn(*args)
    if not torch.cuda.is_available():  # a dry run on the CPU: the wall clock
        began = time.perf_counter()
        for _ in range(repeats):
            fn(*args)
        return (time.perf_counter() - began) * 1e3 / repeats
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    begin.record()
    for _ in range(repeats):
        fn(*args)
    end.record()
    torch.cuda.synchronize()
    return begin.elapsed_time(end) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=17600, help="rows: a Z-Image group of 16 at 512² is ~17600")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--family", choices=["z_image", "qwen_image"], help="that family's shapes only")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    for name, k, n in SHAPES:
        if args.family and not name.startswith(args.family + "."):
            continue
        layer = torch.nn.Linear(k, n, bias=False, device=device, dtype=torch.bfloat16).requires_grad_(False)
        x = torch.randn(args.tokens, k, device=device, dtype=torch.bfloat16)
        gpu = torch.cuda.get_device_name() if device == "cuda" else "cpu"
        row = {"shape": name, "tokens": args.tokens, "in": k, "out": n, "device": gpu}
        flop = 2 * args.tokens * k * n
        with torch.no_grad():
            for way, (fn, arguments) in ways(layer).items():
                ms = time_ms(torch.compile(fn), arguments(x), args.repeats)
                row[way] = {"ms": round(ms, 4), "tflops": round(flop / ms / 1e9, 1)}
        for way in row:
            if isinstance(row[way], dict) and way != "bf16":
                row[way]["speedup"] = round(row["bf16"]["ms"] / row[way]["ms"], 3)
        print(json.dumps(row), flush=True)
        torch._dynamo.reset()


if __name__ == "__main__":
    main()
