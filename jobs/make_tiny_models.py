"""Build random checkpoints locally (nothing is downloaded): the tiny ones used by tests, the CPU demo and
benchmarks, and real-size ones for GPU measurements. Each model family declares its presets
(`ModelFamily.presets`, app/models/<family>/__init__.py); `--help` lists them.

    python -m jobs.make_tiny_models --out .cache/tiny-qwen-image [--seed 0] [--overwrite]
    python -m jobs.make_tiny_models --preset qwen-image-full --out /data/qwen-image-random [--layers 60]
    python -m jobs.make_tiny_models --preset tiny-bagel --out .cache/tiny-bagel
    python -m jobs.make_tiny_models --preset bagel-real-width --out /data/bagel-real-width [--layers 4]
    python -m jobs.make_tiny_models --preset tiny-sd3 --out .cache/tiny-sd3
    python -m jobs.make_tiny_models --preset sd35-medium --out /data/sd35m-random [--layers 24]
    python -m jobs.make_tiny_models --preset tiny-clip --out .cache/tiny-clip   # the CLIP-type rewards' model
    python -m jobs.make_tiny_models --preset tiny-judge --out .cache/tiny-judge  # the VLM judge's

An identical build already at --out is kept unless --overwrite is given.
"""

import argparse
import sys
import time
from pathlib import Path

from app.models.family import FAMILY_NAMES, Preset, get_family

# reward models (app/rewards/): built here as the families' checkpoints are
REWARD_PRESETS = {"tiny-clip": Preset("app.rewards.tiny:build_tiny_clip",
                                      "a tiny CLIPModel + processor and a LAION aesthetic head of the same layout, "
                                      "for reward.pickscore/clipscore/aesthetic"),
                  "tiny-judge": Preset("app.rewards.tiny:build_tiny_judge",
                                       "a tiny Qwen2.5-VL with its processor and chat template, for reward.vlm_judge"),
                  "pickscore-full": Preset("app.rewards.tiny:build_full_clip",
                                           "PickScore's size (CLIP ViT-H/14), random bf16 weights: GPU benches"),
                  "judge-3b-full": Preset("app.rewards.tiny:build_full_judge",
                                          "Qwen2.5-VL-3B's size, random bf16 weights (drawn on the GPU): GPU benches")}


def presets() -> dict:
    """preset name → (family name, Preset), over every registered family, and the reward models ("reward")."""
    families = {name: (family, preset) for family in FAMILY_NAMES
                for name, preset in get_family(family).presets.items()}
    return {**families, **{name: ("reward", preset) for name, preset in REWARD_PRESETS.items()}}


def main(argv: list[str] | None = None) -> int:
    known = presets()
    listing = "\n".join(f"  {name} ({family}): {p.description}" for name, (family, p) in known.items())
    parser = argparse.ArgumentParser(description=__doc__ + "\npresets:\n" + listing,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="checkpoint folder to write")
    parser.add_argument("--preset", choices=list(known), default="tiny")
    parser.add_argument("--seed", type=int, default=0, help="weight seed; same seed gives identical tensors")
    parser.add_argument("--layers", type=int, default=None,
                        help="; ".join(f"{name}: {p.layers_help}" for name, (_, p) in known.items() if p.layers_help))
    parser.add_argument("--overwrite", action="store_true", help="rebuild even if an identical build exists")
    args = parser.parse_args(argv)
    family, preset = known[args.preset]
    started = time.perf_counter()
    out = preset.build(args.out, seed=args.seed, layers=args.layers, overwrite=args.overwrite)
    size_mb = sum(f.stat().st_size for f in Path(out).rglob("*") if f.is_file()) / 2**20
    print(f"{args.preset} {family} checkpoint (seed {args.seed}): {out} ({size_mb:.1f} MB, "
          f"{time.perf_counter() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
