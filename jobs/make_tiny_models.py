"""Build random checkpoints locally (nothing is downloaded): the tiny ones used by tests, the CPU demo and
benchmarks, and real-size ones for GPU measurements.

    python -m jobs.make_tiny_models --out .cache/tiny-qwen-image [--seed 0] [--overwrite]
    python -m jobs.make_tiny_models --preset qwen-image-full --out /data/qwen-image-random [--layers 60]
    python -m jobs.make_tiny_models --preset tiny-bagel --out .cache/tiny-bagel
    python -m jobs.make_tiny_models --preset bagel-real-width --out /data/bagel-real-width [--layers 4]

`tiny` (app/models/tiny.py): fp32, ~3.5 MB, CPU. `tiny-bagel` (app/models/tiny_bagel.py): the BAGEL-7B-MoT layout
(upstream file and tensor names) at a tiny size, fp32, ~17 MB, CPU, seconds. `qwen-image-full`
(app/models/full_random.py): Qwen-Image's transformer (60 blocks, 3072 wide, 20.4B parameters) and VAE, a 2-layer
text encoder of the real width, bf16, built on the GPU (~42 GB on disk). `bagel-real-width`
(app/models/real_width_bagel.py): BAGEL-7B-MoT's LLM width (3584, both experts) with --layers of its 28 layers
(default 4), the real vocabulary, SigLIP so400m's width (2 layers) and the real FLUX autoencoder, bf16, built on the
GPU (~6 GB at 4 layers). An identical build already at --out is kept unless --overwrite is given.
"""

import argparse
import sys
import time
from pathlib import Path

PRESETS = {"tiny": "qwen_image", "qwen-image-full": "qwen_image", "tiny-bagel": "bagel",
           "bagel-real-width": "bagel"}  # preset → model family


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="checkpoint folder to write")
    parser.add_argument("--preset", choices=list(PRESETS), default="tiny")
    parser.add_argument("--seed", type=int, default=0, help="weight seed; same seed gives identical tensors")
    parser.add_argument("--layers", type=int, default=None,
                        help="qwen-image-full: transformer blocks (default and real: 60); "
                             "bagel-real-width: decoder layers (default 4, real: 28)")
    parser.add_argument("--overwrite", action="store_true", help="rebuild even if an identical build exists")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    if args.preset == "tiny":
        from app.models.tiny import build_tiny_qwen_image

        out = build_tiny_qwen_image(args.out, seed=args.seed, overwrite=args.overwrite)
    elif args.preset == "tiny-bagel":
        from app.models.tiny_bagel import build_tiny_bagel

        out = build_tiny_bagel(args.out, seed=args.seed, overwrite=args.overwrite)
    elif args.preset == "bagel-real-width":
        from app.models.real_width_bagel import build_real_width_bagel

        out = build_real_width_bagel(args.out, seed=args.seed, layers=args.layers or 4, overwrite=args.overwrite)
    else:
        from app.models.full_random import build_full_random_qwen_image

        out = build_full_random_qwen_image(args.out, seed=args.seed, num_layers=args.layers or 60,
                                           overwrite=args.overwrite)
    size_mb = sum(f.stat().st_size for f in Path(out).rglob("*") if f.is_file()) / 2**20
    print(f"{args.preset} {PRESETS[args.preset]} checkpoint (seed {args.seed}): {out} ({size_mb:.1f} MB, "
          f"{time.perf_counter() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
