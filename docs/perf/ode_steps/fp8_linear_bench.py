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

Prints one JSON line per shape: milliseconds and TFLOP/s of each, and each one's speed-up over bf16.

    python docs/perf/ode_steps/fp8_linear_bench.py [--tokens 17600]   # a CPU dry run: --tokens 64 --repeats 1
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

from app.rollout.ode_steps import FP8, FP8_MAX, _quantize_weight, fp8_linear_forward, quantize_rows

# (name, in, out): the blocks' linear layers of Z-Image (dim 3840, SwiGLU 10240) and Qwen-Image (3072, GELU 12288)
SHAPES = [("z_image.attn", 3840, 3840), ("z_image.ffn_up", 3840, 10240), ("z_image.ffn_down", 10240, 3840),
          ("qwen_image.attn", 3072, 3072), ("qwen_image.mlp_up", 3072, 12288), ("qwen_image.mlp_down", 12288, 3072)]


def quantize_tensor(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = t.abs().amax().float().clamp(min=1e-12) / FP8_MAX
    return (t.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def ways(layer: torch.nn.Linear):
    w_row, w_scale = layer._ode_fp8_weight, layer._ode_fp8_scale
    w_t, w_t_scale = quantize_tensor(layer.weight.detach())

    def rowwise_mm(q, scale, fast=False):
        return torch._scaled_mm(q, w_row.t(), scale_a=scale, scale_b=w_scale, out_dtype=torch.bfloat16,
                                use_fast_accum=fast)

    def tensorwise(x, fast=False):
        q, scale = quantize_tensor(x)
        return torch._scaled_mm(q, w_t.t(), scale_a=scale, scale_b=w_t_scale, out_dtype=torch.bfloat16,
                                use_fast_accum=fast)

    return {"bf16": lambda x: F.linear(x, layer.weight),
            "fp8_rowwise": lambda x: fp8_linear_forward(layer, x),
            "fp8_rowwise_mm": lambda q, s: rowwise_mm(q, s),
            "fp8_rowwise_fast": lambda x: rowwise_mm(*quantize_rows(x), fast=True),
            "fp8_tensorwise": lambda x: tensorwise(x),
            "fp8_tensorwise_fast": lambda x: tensorwise(x, fast=True)}


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
        _quantize_weight(layer)
        x = torch.randn(args.tokens, k, device=device, dtype=torch.bfloat16)
        gpu = torch.cuda.get_device_name() if device == "cuda" else "cpu"
        row = {"shape": name, "tokens": args.tokens, "in": k, "out": n, "device": gpu}
        flop = 2 * args.tokens * k * n
        with torch.no_grad():
            for way, fn in ways(layer).items():
                compiled = torch.compile(fn)
                call_args = quantize_rows(x) if way == "fp8_rowwise_mm" else (x,)
                ms = time_ms(compiled, call_args, args.repeats)
                row[way] = {"ms": round(ms, 4), "tflops": round(flop / ms / 1e9, 1)}
        for way in row:
            if isinstance(row[way], dict) and way != "bf16":
                row[way]["speedup"] = round(row["bf16"]["ms"] / row[way]["ms"], 3)
        print(json.dumps(row), flush=True)
        torch._dynamo.reset()


if __name__ == "__main__":
    main()
