"""Throughput of the model-based reward terms in one reward replica: images per second and peak GPU memory of each
term at its batch size, on the replica's device (bf16 on a GPU, fp32 on CPUs), through the classes the replicas run
(`ClipReward`, `VlmJudgeReward`).

    python -m jobs.make_tiny_models --preset pickscore-full --out /tmp/pickscore-full   # CLIP ViT-H/14, random
    python -m jobs.make_tiny_models --preset judge-3b-full --out /tmp/judge-3b          # Qwen2.5-VL-3B, random
    python -m jobs.bench_rewards --pickscore /tmp/pickscore-full --judge /tmp/judge-3b [--images 64] [--batch 16]

The images are text rendered on noise at the rollout's size (jobs.bench_ocr's). Random weights: the judge's
reading runs to --max-new-tokens (nothing ends it early), an upper bound on what a trained judge spends. Prints one
JSON line per term and judge mode: img/s (median of --repeats passes after a warm-up batch), peak GiB.
"""

import argparse
import statistics
import sys
import time

from jobs.bench_ocr import sign_images
from jobs.report import emit_json_line


def bench(reward, images, prompts, repeats: int) -> dict:
    import torch

    reward.score(images[:reward.batch_size], prompts[:reward.batch_size])  # warm-up: kernels, allocator
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        reward.score(images, prompts)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None
    return {"images_per_s": round(len(images) / statistics.median(times), 2),
            "peak_gib": round(peak, 2) if peak is not None else None, "device": str(reward.device),
            "dtype": str(reward.dtype).removeprefix("torch.")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pickscore", help="a CLIPModel folder (PickScore_v1, or --preset pickscore-full)")
    parser.add_argument("--judge", help="a Qwen2.5-VL / Qwen3-VL folder (or --preset judge-3b-full)")
    parser.add_argument("--modes", nargs="+", default=["yesno", "ocr"], choices=["yesno", "ocr"])
    parser.add_argument("--images", type=int, default=64)
    parser.add_argument("--size", type=int, default=512)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    if not (args.pickscore or args.judge):
        parser.error("give --pickscore, --judge or both")
    images, prompts = sign_images(args.images, args.size)
    common = {"images": args.images, "size": args.size, "batch": args.batch}
    if args.pickscore:
        from app.rewards.clip import ClipReward

        reward = ClipReward("pickscore", args.pickscore, batch_size=args.batch)
        emit_json_line({"bench": "reward", "term": "pickscore", **common, **bench(reward, images, prompts,
                                                                                 args.repeats)})
        del reward
    for mode in args.modes if args.judge else []:
        from app.rewards.judge import VlmJudgeReward

        judge = VlmJudgeReward(args.judge, mode=mode, batch_size=args.batch, max_new_tokens=args.max_new_tokens)
        emit_json_line({"bench": "reward", "term": "vlm_judge", "mode": mode, **common,
                        **({"max_new_tokens": args.max_new_tokens} if mode == "ocr" else {}),
                        **bench(judge, images, prompts, args.repeats)})
        del judge
    return 0


if __name__ == "__main__":
    sys.exit(main())
