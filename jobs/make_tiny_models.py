"""Build the deterministic tiny random checkpoints used by tests, the CPU demo and benchmarks.

    python -m jobs.make_tiny_models --out .cache/tiny-qwen-image [--seed 0] [--overwrite]

Nothing is downloaded: the tokenizer is trained and the weights are initialised here (see app/models/tiny.py).
An identical build already at --out is kept unless --overwrite is given.
"""

import argparse
import sys
from pathlib import Path

from app.models.tiny import build_tiny_qwen_image


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="checkpoint folder to write (diffusers layout)")
    parser.add_argument("--seed", type=int, default=0, help="weight seed; same seed gives identical tensors")
    parser.add_argument("--overwrite", action="store_true", help="rebuild even if an identical build exists")
    args = parser.parse_args(argv)
    out = build_tiny_qwen_image(args.out, seed=args.seed, overwrite=args.overwrite)
    size_mb = sum(f.stat().st_size for f in Path(out).rglob("*") if f.is_file()) / 2**20
    print(f"tiny qwen_image checkpoint (seed {args.seed}): {out} ({size_mb:.1f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
