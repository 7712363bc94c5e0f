"""What every tiny build shares: a Qwen2 byte-level BPE tokenizer trained here (Qwen-Image's text encoder and
BAGEL's LLM both read Qwen2 tokens; no hub access exists on our machines), and the atomic write of a build with its
build info, so a reader never sees half a model and an identical build is kept."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

# Qwen-Image's chat template, as both pipelines hard-code it; the prompt goes where {} is.
QWEN_IMAGE_TEMPLATE = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, spatial "
    "relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
)
QWEN_IMAGE_TEMPLATE_START_IDX = 34  # tokens of the system prefix dropped by the pipelines
# Qwen2's pre-tokenizer split pattern (what Qwen2Tokenizer builds from vocab + merges)
_QWEN2_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
                r"""\s*[\r\n]+|\s+(?!\S)|\s+""")
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                   "<|image_pad|>", "<|video_pad|>"]
# prompts every tiny tokenizer is trained on (Qwen2's inside Qwen-Image's template; SD3's CLIP and T5 as they are)
PROMPT_CORPUS = (
    'a sign that says "OPEN 24H"', 'a red cube on a blue table', 'a photo of a cat', 'text reading "HELLO"',
    'a neon sign with the words "RAY"', 'a poster that says "FLOW GRPO 2026"', 'sunset over the mountains',
    'a green tree next to a yellow car', 'the quick brown fox jumps over the lazy dog 0123456789',
)
_CORPUS = [QWEN_IMAGE_TEMPLATE.format(p) for p in PROMPT_CORPUS] * 8
BUILD_INFO_FILE = "tiny_build.json"

def train_tokenizer(vocab_size: int = 1024):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import Qwen2Tokenizer

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(_CORPUS, trainer)
    model = json.loads(bpe.to_str())["model"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    tokenizer = Qwen2Tokenizer(vocab=model["vocab"], merges=merges, unk_token=None, bos_token=None,
                               eos_token="<|im_end|>",
                               pad_token="<|endoftext|>", errors="replace")
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS[1:]})
    return tokenizer


def write_build(out: Path, wanted: dict, save, *, overwrite: bool = False) -> Path:
    """`save(folder)` writes a checkpoint, recorded with its build info `wanted`, unless the same build is already at
    `out`. The folder is written next to its destination and renamed into place: a reader never sees half a model."""
    if not overwrite and is_tiny_build(out, wanted):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        save(staging)
        (staging / BUILD_INFO_FILE).write_text(json.dumps(wanted, indent=1) + "\n")
        if out.exists():
            shutil.rmtree(out)
        staging.rename(out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


def is_tiny_build(path: str | os.PathLike, wanted: dict | None = None) -> bool:
    """True when `path` holds a finished tiny build (with the given seed/version when `wanted` is given)."""
    info = Path(path) / BUILD_INFO_FILE
    if not info.is_file():
        return False
    return wanted is None or json.loads(info.read_text()) == wanted


def randomise(module, generator, std: float = 0.02) -> None:
    """Every parameter of `module` drawn in name order (the real-size random builders): matrices N(0, std), 1-d norm
    scales 1, other vectors 0. Same generator state → identical weights."""
    import torch

    with torch.no_grad():
        for name, p in sorted(module.named_parameters(), key=lambda item: item[0]):
            if p.ndim >= 2:
                p.normal_(0.0, std, generator=generator)
            elif "norm" in name and name.endswith("weight"):
                p.fill_(1.0)
            else:
                p.zero_()
