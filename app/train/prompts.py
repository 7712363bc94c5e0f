"""Training prompts: a text file (one prompt per line) or a built-in set, and which prompts each step uses.

The order is a pure function of (seed, step): a seeded permutation per pass over the prompts, so the data
position of a run is just the number of groups drawn so far, and a resumed run sees exactly the prompts the
uninterrupted run would have seen.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from app.rollout.seeding import derived_seed

if TYPE_CHECKING:
    from app.config import RolloutConfig
    from app.types import GenerationRequest

# OCR-style prompts (target text in double quotes) for the tiny CPU runs and tests
BUILTIN = {
    "ocr_tiny": [
        'A storefront sign that says "OPEN"',
        'A chalkboard with the word "HELLO" written on it',
        'A street sign reading "MAIN ST"',
        'A coffee cup printed with "LATTE"',
        'A neon sign that says "BAR"',
        'A book cover titled "RAY"',
        'A poster with the text "SALE 50%"',
        'A license plate showing "FLOW 42"',
    ],
}


def load_prompts(source: str) -> list[str]:
    """The prompts of `data.prompts`: a built-in set name or a UTF-8 text file (blank lines and '#' lines skipped)."""
    if source in BUILTIN:
        return list(BUILTIN[source])
    path = Path(source).expanduser()
    if not path.is_file():
        raise ValueError(f"data.prompts={source!r} is neither a file nor a built-in set ({', '.join(BUILTIN)})")
    prompts = [line.strip() for line in path.read_text(encoding="utf-8").splitlines()]
    prompts = [p for p in prompts if p and not p.startswith("#")]
    if not prompts:
        raise ValueError(f"data.prompts={source!r} holds no prompts (one per line; '#' starts a comment)")
    return prompts


def step_prompts(prompts: list[str], step: int, groups_per_step: int, *, seed: int,
                 shuffle: bool = True) -> list[tuple[int, str]]:
    """The (global group index, prompt) pairs of one optimizer step, over all workers.

    Group g is the g-th prompt drawn since the start of the run; pass e = g // len(prompts) visits the prompts in
    a permutation seeded by (seed, e) (in file order without shuffle).
    """
    out = []
    for g in range(step * groups_per_step, (step + 1) * groups_per_step):
        epoch, position = divmod(g, len(prompts))
        order = (np.random.default_rng([seed, epoch]).permutation(len(prompts)) if shuffle
                 else np.arange(len(prompts)))
        out.append((g, prompts[int(order[position])]))
    return out


def group_seed(seed: int, group: int) -> int:
    """The rollout seed of global group `group` (63-bit, SeedSequence-mixed, distinct per group)."""
    return derived_seed(seed, group, 0x5EED)


def group_request(rollout: RolloutConfig, prompt: str, group: int, *, seed: int,
                  lora_version: int | None = None) -> GenerationRequest:
    """The request for global group `group` of a run seeded `seed`: sampled as the rollout section says, seeded
    per group, and asking for adapter `lora_version`."""
    return rollout.request(prompt, seed=group_seed(seed, group), group_id=group, lora_version=lora_version)
