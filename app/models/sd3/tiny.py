"""Deterministic tiny random Stable Diffusion 3 checkpoints, built locally (no hub access exists on our machines).

The checkpoint has SD3.5's diffusers layout (`model_index.json`, `transformer/`, `vae/`, `text_encoder/` CLIP-L,
`text_encoder_2/` CLIP-G, `text_encoder_3/` T5, their three tokenizers, `scheduler/`) in fp32, so diffusers'
`StableDiffusion3Pipeline` and vllm-omni's SD3 pipeline load it like the real model. The MMDiT has SD3.5-Medium's
features at a tiny width: RMS-normed queries and keys, a dual-attention layer (layer 0) and a last layer whose text
stream ends early (`context_pre_only`). Same seed → identical tensors and tokenizers.

Tokenizers are made here from a small corpus with the real ones' algorithms, deterministically: CLIP's byte-level
BPE (lower-cased, `</w>` word ends; `CLIPTokenizer` builds its own pipeline from the vocabulary and merges) and
T5's unigram model (`T5Tokenizer` from scored pieces). Every letter, digit and common punctuation mark is in both
vocabularies, so any prompt of our prompt sets tokenizes without unknown pieces.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from app.models.builds import PROMPT_CORPUS, write_build

BUILDER_VERSION = 2  # bump when the architecture below changes, so cached checkpoints are rebuilt

CLIP_MAX_LENGTH = 77  # CLIP's context; SD3 pads both CLIP prompts to it
CLIP_SPECIALS = ["<|startoftext|>", "<|endoftext|>"]
T5_SPECIALS = ["<pad>", "</s>", "<unk>"]
# Architecture: every size the pipelines tie together, in one place. SD3 concatenates the two CLIPs' penultimate
# states (zero-padded to the T5 width) with T5's along the sequence, and their pooled projections side by side.
CLIP_HIDDEN = 16  # each CLIP's width and projection: pooled = 2 x 16
T5_HIDDEN = 32  # == transformer joint_attention_dim (>= 2 x CLIP_HIDDEN)
TRANSFORMER = dict(sample_size=8, patch_size=2, in_channels=16, out_channels=16, num_layers=2, attention_head_dim=8,
                   num_attention_heads=4, joint_attention_dim=T5_HIDDEN, caption_projection_dim=32,
                   pooled_projection_dim=2 * CLIP_HIDDEN, pos_embed_max_size=32, qk_norm="rms_norm",
                   dual_attention_layers=(0,))
# SD3.5's latent normalisation (the VAE's scaling and shift factors)
VAE_SCALING, VAE_SHIFT = 1.5305, 0.0609
_CHARACTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789\"'.,:;!?-&#%+/()=@*$_[]<>"
_ALPHABET = " ".join(_CHARACTERS)  # each one a word of its own: a word end for every character


def _corpus() -> list[str]:
    return [*PROMPT_CORPUS, _ALPHABET] * 8


def _clip_pipeline():
    """CLIPTokenizer's own normaliser and pre-tokeniser (lower-cased NFC text split into words, byte-level)."""
    from transformers import CLIPTokenizer

    return CLIPTokenizer().backend_tokenizer


def train_clip_tokenizer(vocab_size: int = 600):
    """A CLIP tokenizer (byte-level BPE, lower-cased, `</w>` at word ends) learnt from the tiny corpus.

    The merges are learnt here rather than by `tokenizers`' trainer, whose ties between equally frequent pairs fall
    differently from process to process: the most frequent pair is merged first, ties go to the smaller pair, so the
    same corpus always gives the same vocabulary."""
    from collections import Counter

    from tokenizers import pre_tokenizers
    from transformers import CLIPTokenizer

    pipeline = _clip_pipeline()
    words: Counter[tuple[str, ...]] = Counter()
    for text in _corpus():
        for piece, _ in pipeline.pre_tokenizer.pre_tokenize_str(pipeline.normalizer.normalize_str(text)):
            words[(*piece[:-1], piece[-1] + "</w>")] += 1
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {token: i for i, token in enumerate([*CLIP_SPECIALS, *alphabet, *(c + "</w>" for c in alphabet)])}
    merges = []
    while len(vocab) < vocab_size:
        pairs: Counter[tuple[str, str]] = Counter()
        for word, count in words.items():
            for pair in zip(word, word[1:], strict=False):
                pairs[pair] += count
        if not pairs:
            break
        best = min(pairs, key=lambda pair: (-pairs[pair], pair))
        if pairs[best] < 2:
            break
        merges.append(best)
        vocab.setdefault("".join(best), len(vocab))
        words = Counter({_merged(word, best): count for word, count in words.items()})
    return CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=CLIP_MAX_LENGTH)


def _merged(word: tuple[str, ...], pair: tuple[str, str]) -> tuple[str, ...]:
    out, i = [], 0
    while i < len(word):
        if word[i:i + 2] == pair:
            out.append(word[i] + word[i + 1])
            i += 2
        else:
            out.append(word[i])
            i += 1
    return tuple(out)


def train_t5_tokenizer():
    """A T5 tokenizer (unigram pieces, `▁` at word starts) made from the tiny corpus: every word of it a piece scored
    by its log-frequency, every character a piece alone and after `▁` at a score no word beats, so any text of our
    alphabet splits into known pieces. Deterministic (no trainer)."""
    import math
    from collections import Counter

    from transformers import T5Tokenizer

    words = Counter(f"▁{w}" for text in _corpus() for w in text.split())
    total = sum(words.values())
    chars = sorted(set(_CHARACTERS))
    pieces = [(word, math.log(count / total)) for word, count in words.items()]
    pieces += [("▁", -20.0)] + [(c, -20.0) for c in chars] + [(f"▁{c}", -20.0) for c in chars if f"▁{c}" not in words]
    pieces = sorted(dict(pieces).items(), key=lambda item: (-item[1], item[0]))
    vocab = [(token, 0.0) for token in T5_SPECIALS] + pieces  # <unk> at id 2, as T5Tokenizer's model expects
    return T5Tokenizer(vocab=vocab, extra_ids=0, model_max_length=512)


def tiny_sd3_components(seed: int = 0) -> dict:
    """The nine pipeline components, random but reproducible: same seed → identical tensors."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel

    clip_tokenizer, t5_tokenizer = train_clip_tokenizer(), train_t5_tokenizer()
    bos, eos = (clip_tokenizer.convert_tokens_to_ids(t) for t in CLIP_SPECIALS)
    clip = dict(vocab_size=len(clip_tokenizer), hidden_size=CLIP_HIDDEN, intermediate_size=32, num_hidden_layers=2,
                num_attention_heads=2, projection_dim=CLIP_HIDDEN, max_position_embeddings=CLIP_MAX_LENGTH,
                bos_token_id=bos, eos_token_id=eos, pad_token_id=eos, hidden_act="gelu")
    with torch.random.fork_rng(devices=[]):  # the caller's RNG state is left alone
        torch.manual_seed(seed)
        text_encoder = CLIPTextModelWithProjection(CLIPTextConfig(**clip)).eval()
        text_encoder_2 = CLIPTextModelWithProjection(CLIPTextConfig(**clip)).eval()
        text_encoder_3 = T5EncoderModel(T5Config(
            vocab_size=len(t5_tokenizer), d_model=T5_HIDDEN, d_kv=8, d_ff=32, num_layers=2, num_heads=4,
            feed_forward_proj="gated-gelu", pad_token_id=t5_tokenizer.pad_token_id,
            eos_token_id=t5_tokenizer.eos_token_id, decoder_start_token_id=t5_tokenizer.pad_token_id)).eval()
        transformer = SD3Transformer2DModel(**TRANSFORMER)
        vae = AutoencoderKL(in_channels=3, out_channels=3, latent_channels=16, block_out_channels=(8, 16, 16, 16),
                            down_block_types=["DownEncoderBlock2D"] * 4, up_block_types=["UpDecoderBlock2D"] * 4,
                            layers_per_block=1, norm_num_groups=4, sample_size=64, scaling_factor=VAE_SCALING,
                            shift_factor=VAE_SHIFT, use_quant_conv=False, use_post_quant_conv=False)
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)  # SD3.5's
    return dict(transformer=transformer, scheduler=scheduler, vae=vae, text_encoder=text_encoder,
                tokenizer=clip_tokenizer, text_encoder_2=text_encoder_2, tokenizer_2=clip_tokenizer,
                text_encoder_3=text_encoder_3, tokenizer_3=t5_tokenizer)


def build_tiny_sd3(out_dir: str | os.PathLike, seed: int = 0, *, overwrite: bool = False) -> Path:
    """Write a tiny checkpoint to `out_dir` (fp32, diffusers layout) unless an identical build is already there."""
    def save(staging: Path) -> None:
        from diffusers import StableDiffusion3Pipeline  # only when building: the import is seconds of a job's start

        StableDiffusion3Pipeline(**tiny_sd3_components(seed)).save_pretrained(staging)

    out = Path(out_dir).resolve()
    wanted = {"family": "sd3", "seed": seed, "builder_version": BUILDER_VERSION}
    return write_build(out, wanted, save, overwrite=overwrite)
