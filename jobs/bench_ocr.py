"""OCR reward throughput of one reward replica by the CPUs it holds: images per second read by 1..N engines at
once (`OcrReward(threads=k)`, what a replica of `reward.replica_num_cpus: k` runs), side by side in one process;
with `--device cpu cuda`, each thread count with the networks on the CPUs (onnxruntime) and on the GPU (torch).

    python -m jobs.bench_ocr [--threads 1 2 4] [--images 16] [--size 512] [--device cpu cuda]

The images are text rendered on noise at the rollout's size (the detector's work grows with it). Prints one JSON
line: img/s per thread count (median of --repeats passes) and each one's speed-up over one engine.
"""

import argparse
import statistics
import sys
import time

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from app.rewards.ocr import OcrReward
from jobs.report import emit_json_line


def sign_images(count: int, size: int, seed: int = 0) -> tuple[np.ndarray, list[str]]:
    rng = np.random.default_rng(seed)
    images, prompts = [], []
    for i in range(count):
        text = f"OPEN {i} STORE"
        image = Image.fromarray((rng.random((size, size, 3)) * 60 + 150).astype(np.uint8))
        ImageDraw.Draw(image).text((size // 10, size // 2), text, fill=(0, 0, 0),
                                   font=ImageFont.load_default(size=max(8, size // 11)))
        images.append(np.asarray(image))
        prompts.append(f'a sign that says "{text}"')
    return np.stack(images), prompts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--images", type=int, default=16)
    parser.add_argument("--size", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", nargs="+", default=["cpu"], choices=["cpu", "cuda"],
                        help="where the networks run: cpu (onnxruntime), cuda (torch)")
    args = parser.parse_args(argv)
    images, prompts = sign_images(args.images, args.size)
    rates, scores = {}, {}
    for device in args.device:
        for threads in args.threads:
            key = str(threads) if args.device == ["cpu"] else f"{device}/{threads}"
            reward = OcrReward(threads=threads, device=device)
            reward.score(images[:threads], prompts[:threads])  # warm-up: every engine has run once
            times = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                scores[key] = reward.score(images, prompts)
                times.append(time.perf_counter() - start)
            rates[key] = args.images / statistics.median(times)
    first = next(iter(rates))
    emit_json_line({"bench": "ocr", "images": args.images, "size": args.size,
                    "images_per_s": {k: round(v, 2) for k, v in rates.items()},
                    "speedup": {k: round(v / rates[first], 2) for k, v in rates.items()},
                    "same_scores": all(s == scores[first] for s in scores.values()),
                    "mean_score": round(float(np.mean(scores[first])), 3)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
