"""Built-in evaluation sets: held-out OCR prompts with a known target text, and edits of rendered signs.

Every set is enumerated, not sampled: the same list on every machine and in every version of numpy. None shares a
prompt or a target text with a training set (`app.train.prompts`); `tests/eval/test_sets.py` checks it.

    ocr_eval            512 text-to-image prompts: 16 scenes x 512 distinct texts (one word, two words, a word
                        and a number), the held-out OCR set of a real run
    ocr_eval_tiny       its first 4 prompts (CPU runs and tests)
    ocr_edit_eval       64 edits: a rendered sign showing one word, the instruction asks for another
    ocr_edit_eval_tiny  its first 2 edits
"""

from __future__ import annotations

from functools import cache
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from app.config import RunConfig
    from app.train.prompts import Prompt

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
    from app.train.prompts import EditPrompt, rendered_sign

    return [EditPrompt(EDIT_INSTRUCTION.format(new), rendered_sign(old, size)) for old, new in _edit_pairs()]


def ocr_edit_eval_tiny() -> list:
    return ocr_edit_eval()[:2]


# name -> builder of the set's prompts (str, or app.train.prompts.EditPrompt for an edit)
EVAL_SETS = {"ocr_eval": lambda: list(ocr_eval()), "ocr_eval_tiny": lambda: list(ocr_eval_tiny()),
             "ocr_edit_eval": ocr_edit_eval, "ocr_edit_eval_tiny": ocr_edit_eval_tiny}


def eval_prompts(config: RunConfig) -> list[Prompt]:
    """The eval set of `eval.prompts`, its first `eval.max_prompts`."""
    from app.train.prompts import load_prompts

    prompts = load_prompts(config.eval.prompts, "eval.prompts")
    return prompts[:config.eval.max_prompts] if config.eval.max_prompts else prompts


def overlap(eval_set: list[Prompt], training: list[Prompt]) -> int:
    """How many eval prompts are also training prompts (the same text; for an edit, the same text and image)."""
    def key(p):
        image = getattr(p, "image", None)
        return str(p), None if image is None else (image.shape, image.tobytes())

    seen = {key(p) for p in training}
    return sum(key(p) in seen for p in eval_set)
