"""Prompt sets, training and held-out alike: a text file (one prompt per line), a JSON-lines file
(`{"prompt": ..., "image": path}`: an image turns the line into an edit of that image), or a built-in set by name.

Training sets (OCR-style prompts, the target text in double quotes, for the tiny CPU runs and tests):

    ocr_tiny            8 text-to-image prompts
    ocr_edit_tiny       8 edits of rendered signs
    ocr_mixed_tiny      both

Evaluation sets, held out: every set is enumerated, not sampled (the same list on every machine and in every
version of numpy), and none shares a prompt or a target text with a training set (`tests/eval/test_sets.py`):

    ocr_eval            512 text-to-image prompts: 16 scenes x 512 distinct texts (one word, two words, a word
                        and a number), the held-out OCR set of a real run
    ocr_eval_tiny       its first 4 prompts (CPU runs and tests)
    ocr_edit_eval       64 edits: a rendered sign showing one word, the instruction asks for another
    ocr_edit_eval_tiny  its first 2 edits

Which prompts each training step draws is `app.train.prompts`; which the evaluation uses, `eval_prompts`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from app.config import RunConfig

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
    (training or evaluation, below), a UTF-8 text file (blank lines and '#' lines skipped), or a
    `.jsonl` file of `{"prompt": ...}` / `{"prompt": ..., "image": path relative to the file}` (an edit)."""
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


def _mixed_tiny() -> list[Prompt]:
    return [*BUILTIN["ocr_tiny"], *_tiny_edits()]


BUILTIN_EDITS = {"ocr_edit_tiny": _tiny_edits, "ocr_mixed_tiny": _mixed_tiny}


# scenes the target text is placed in (the text goes in double quotes: the OCR reward's target)
SCENES = (
    'A wooden sign over a shop door that reads "{}"',
    'A bright billboard beside a highway showing "{}"',
    'A hand-painted banner at a street fair with the words "{}"',
    'A ceramic mug printed with "{}"',
    'A paperback book cover titled "{}"',
    'A neon light in a dark window spelling "{}"',
    'A train station departure board announcing "{}"',
    'A birthday cake with icing that says "{}"',
    'A white T-shirt with "{}" printed across the chest',
    'A road sign in the desert that says "{}"',
    'A chalk message on a sidewalk reading "{}"',
    'A movie poster with the title "{}"',
    'A cardboard box stamped "{}"',
    'A laptop sticker that says "{}"',
    'A restaurant menu board headed "{}"',
    'A vintage postcard with the caption "{}"',
)
# words no training set uses (the training sets' texts: OPEN, HELLO, MAIN ST, LATTE, BAR, RAY, SALE 50%, FLOW 42,
# and the tiny edits' CLOSED, BYE, SOLD, OAK ST, TEA, CAFE, STOP, GO)
WORDS = (
    "BAKERY", "GARDEN", "PLANET", "RIVER", "SUNSET", "MARKET", "HARBOR", "CANDLE", "FOREST", "BRIDGE", "WINTER",
    "SUMMER", "PUZZLE", "ROCKET", "VIOLET", "ORANGE", "SILVER", "GOLDEN", "MEADOW", "CASTLE", "TUNNEL", "ISLAND",
    "CIRCUS", "PIRATE", "DRAGON", "TIGER", "PANDA", "ZEBRA", "LEMON", "MANGO", "PEPPER", "HONEY", "COCOA", "BREAD",
    "PIZZA", "PASTA", "SALAD", "DINER", "MOTEL", "HOTEL", "MUSEUM", "THEATER", "LIBRARY", "SCHOOL", "STUDIO",
    "GALAXY", "COMET", "ORBIT", "PIXEL", "ROBOT", "LASER", "RADIO", "JAZZ", "BLUES", "DISCO", "TANGO", "WALTZ",
    "NORTH", "SOUTH", "EAST", "WEST", "ZERO", "QUIZ", "EXIT",
)
EDIT_INSTRUCTION = 'Change the sign so that it says "{}"'


@cache
def _ocr_texts() -> tuple[str, ...]:
    """512 distinct texts: the 64 words; 128 pairs of different words; 320 word + two-digit number pairs."""
    n = len(WORDS)
    singles = list(WORDS)
    # the second word is 1..n-1 places after the first: never the same word
    pairs = [f"{WORDS[i % n]} {WORDS[(i % n + 1 + (5 * i + 13 * (i // n)) % (n - 1)) % n]}" for i in range(128)]
    numbered = [f"{WORDS[i % n]} {10 + (i * 37) % 90}" for i in range(320)]
    texts = tuple(singles + pairs + numbered)
    if len(set(texts)) != len(texts) or any(len(set(t.split())) < len(t.split()) for t in texts):
        raise AssertionError("the OCR eval texts must be distinct and without a repeated word")
    return texts


@cache
def ocr_eval() -> tuple[str, ...]:
    """The 512 held-out OCR prompts: text k in scene k mod 16 (every scene meets every kind of text)."""
    return tuple(SCENES[k % len(SCENES)].format(text) for k, text in enumerate(_ocr_texts()))


def ocr_eval_tiny() -> tuple[str, ...]:
    return ocr_eval()[:4]


def _edit_pairs() -> list[tuple[str, str]]:
    """(the text the input sign shows, the text asked for): 64 pairs of different eval words."""
    n = len(WORDS)
    return [(WORDS[i], WORDS[(i * 7 + 3) % n]) for i in range(n)]


def ocr_edit_eval(size: int = 64) -> list:
    return [EditPrompt(EDIT_INSTRUCTION.format(new), rendered_sign(old, size)) for old, new in _edit_pairs()]


def ocr_edit_eval_tiny() -> list:
    return ocr_edit_eval()[:2]


# name -> builder of the set's prompts (str, or EditPrompt for an edit)
EVAL_SETS = {"ocr_eval": lambda: list(ocr_eval()), "ocr_eval_tiny": lambda: list(ocr_eval_tiny()),
             "ocr_edit_eval": ocr_edit_eval, "ocr_edit_eval_tiny": ocr_edit_eval_tiny}


def eval_prompts(config: RunConfig) -> list[Prompt]:
    """The eval set of `eval.prompts`, its first `eval.max_prompts`."""
    prompts = load_prompts(config.eval.prompts, "eval.prompts")
    return prompts[:config.eval.max_prompts] if config.eval.max_prompts else prompts


def overlap(eval_set: list[Prompt], training: list[Prompt]) -> int:
    """How many eval prompts are also training prompts (the same text; for an edit, the same text and image)."""
    def key(p):
        image = getattr(p, "image", None)
        return str(p), None if image is None else (image.shape, image.tobytes())

    seen = {key(p) for p in training}
    return sum(key(p) in seen for p in eval_set)
