"""Training prompts: a text file (one prompt per line), a JSON-lines file (`{"prompt": ..., "image": path}`: an
image turns the line into an edit of that image), or a built-in set; and which prompts each step uses.

The order is a pure function of (seed, step): a seeded permutation per pass over the prompts, so the data
position of a run is just the number of groups drawn so far, and a resumed run sees exactly the prompts the
uninterrupted run would have seen.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from app.rollout.seeding import derived_seed

if TYPE_CHECKING:
    from app.config import RolloutConfig
    from app.types import GenerationRequest

# OCR-style prompts (target text in double quotes) for the tiny CPU runs and tests; the edit sets are built on
# first use (their images are rendered)
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


@dataclass(frozen=True, eq=False)
class EditPrompt:
    """An edit: what to change (`prompt`; for the OCR reward the new text in double quotes) in `image`."""

    prompt: str
    image: np.ndarray  # uint8 [H, W, 3]

    def __str__(self) -> str:
        return self.prompt


Prompt = str | EditPrompt

# edits of rendered signs: (the text the input image shows, the text the instruction asks for)
_TINY_EDITS = [("CLOSED", "OPEN"), ("HELLO", "BYE"), ("SALE", "SOLD"), ("MAIN ST", "OAK ST"), ("TEA", "LATTE"),
               ("BAR", "CAFE"), ("RAY", "FLOW"), ("STOP", "GO")]


def rendered_sign(text: str, size: int = 64) -> np.ndarray:
    """A deterministic picture of a sign showing `text` (black on white, Pillow's bundled font)."""
    from PIL import Image, ImageDraw, ImageFont

    image = Image.new("RGB", (size, size), "white")
    font = ImageFont.load_default(size=max(8, size // max(3, len(text))))
    draw = ImageDraw.Draw(image)
    left, top, right, bottom = draw.textbbox((0, 0), text, font=font)
    draw.text(((size - (right - left)) / 2 - left, (size - (bottom - top)) / 2 - top), text, fill="black", font=font)
    return np.asarray(image).copy()


def _tiny_edits() -> list[EditPrompt]:
    return [EditPrompt(f'Change the sign so that it says "{new}"', rendered_sign(old)) for old, new in _TINY_EDITS]


def load_prompts(source: str, key: str = "data.prompts") -> list[Prompt]:
    """The prompts of `data.prompts` (or of the setting `key` names, e.g. eval.prompts): a built-in set name
    (training or evaluation, `app/eval/sets.py`), a UTF-8 text file (blank lines and '#' lines skipped), or a
    `.jsonl` file of `{"prompt": ...}` / `{"prompt": ..., "image": path relative to the file}` (an edit)."""
    from app.eval.sets import EVAL_SETS

    if source in BUILTIN:
        return list(BUILTIN[source])
    if source in BUILTIN_EDITS:
        return BUILTIN_EDITS[source]()
    if source in EVAL_SETS:
        return EVAL_SETS[source]()
    path = Path(source).expanduser()
    if not path.is_file():
        raise ValueError(f"{key}={source!r} is neither a file nor a built-in set "
                         f"({', '.join([*BUILTIN, *BUILTIN_EDITS, *EVAL_SETS])})")
    if path.suffix == ".jsonl":
        return _jsonl_prompts(path, source, key)
    prompts = [line.strip() for line in path.read_text(encoding="utf-8").splitlines()]
    prompts = [p for p in prompts if p and not p.startswith("#")]
    if not prompts:
        raise ValueError(f"{key}={source!r} holds no prompts (one per line; '#' starts a comment)")
    return prompts


def _jsonl_prompts(path: Path, source: str, key: str) -> list[Prompt]:
    from PIL import Image

    prompts: list[Prompt] = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{key}={source!r} line {number}"
        try:
            item = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{where} is not JSON ({err.msg})") from None
        if not isinstance(item, dict) or not isinstance(item.get("prompt"), str) or not item["prompt"].strip():
            raise ValueError(f'{where} needs a non-empty "prompt" string')
        if item.get("image") is None:
            prompts.append(item["prompt"])
            continue
        image_path = path.parent / str(item["image"])
        try:
            with Image.open(image_path) as im:
                prompts.append(EditPrompt(item["prompt"], np.asarray(im.convert("RGB")).copy()))
        except OSError:
            raise ValueError(f"{where}: image {str(image_path)!r} is not a readable image") from None
    if not prompts:
        raise ValueError(f"{key}={source!r} holds no prompts")
    return prompts


def step_prompts(prompts: list[Prompt], step: int, groups_per_step: int, *, seed: int,
                 shuffle: bool = True) -> list[tuple[int, Prompt]]:
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


def group_request(rollout: RolloutConfig, prompt: Prompt, group: int, *, seed: int, step: int = 0,
                  lora_version: int | None = None) -> GenerationRequest:
    """The request for global group `group` of a run seeded `seed`, trained at step `step`: sampled as the
    rollout section says (its SDE window placed for this group and step), seeded per group, and asking for adapter
    `lora_version` (an edit prompt's request carries its image)."""
    import torch

    edit = {"image": torch.from_numpy(prompt.image)} if isinstance(prompt, EditPrompt) else {}
    window = rollout.sde_window.window(rollout.num_inference_steps, seed=seed, group=group, step=step)
    return rollout.request(str(prompt), seed=group_seed(seed, group), group_id=group, lora_version=lora_version,
                           sde_window=window, **edit)


def _mixed_tiny() -> list[Prompt]:
    return [*BUILTIN["ocr_tiny"], *_tiny_edits()]


BUILTIN_EDITS = {"ocr_edit_tiny": _tiny_edits, "ocr_mixed_tiny": _mixed_tiny}
