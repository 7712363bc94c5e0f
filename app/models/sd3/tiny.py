"""Deterministic tiny random Stable Diffusion 3 checkpoints, built locally (no hub access exists on our machines).

The checkpoint has SD3.5's diffusers layout (`model_index.json`, `transformer/`, `vae/`, `text_encoder/` CLIP-L,
`text_encoder_2/` CLIP-G, `text_encoder_3/` T5, their three tokenizers, `scheduler/`) in fp32, so diffusers'
`StableDiffusion3Pipeline` and vllm-omni's SD3 pipeline load it like the real model. The MMDiT has SD3.5-Medium's
features at a tiny width: RMS-normed queries and keys, a dual-attention layer (layer 0) and a last layer whose text
stream ends early (`context_pre_only`). Same seed → identical tensors and tokenizers.

Tokenizers are trained here on a small corpus with the real ones' algorithms: CLIP's byte-level BPE (lower-cased,
`</w>` word ends; `CLIPTokenizer` builds its own pipeline from the vocabulary and merges) and T5's unigram model
(`T5Tokenizer` from scored pieces). Every letter, digit and common punctuation mark is in both vocabularies, so any
prompt of our prompt sets tokenizes without unknown pieces.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from app.models.builds import PROMPT_CORPUS, write_build

BUILDER_VERSION = 1  # bump when the architecture below changes, so cached checkpoints are rebuilt

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
_CHARACTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789\"'.,:;!?-&#%+/()"
_ALPHABET = " ".join(_CHARACTERS)  # each one a word of its own: a word end for every character


def _corpus() -> list[str]:
    return [*PROMPT_CORPUS, _ALPHABET] * 8


def train_clip_tokenizer(vocab_size: int = 600):
    """A CLIP tokenizer (byte-level BPE, lower-cased, `</w>` at word ends) trained on the tiny corpus."""
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers import CLIPTokenizer

    bpe = Tokenizer(models.BPE(end_of_word_suffix="</w>"))
    # CLIPTokenizer's own normaliser and pre-tokeniser: the merges are learnt on the pieces it will split
    bpe.normalizer = normalizers.Sequence([normalizers.NFC(), normalizers.Replace(Regex(r"\s+"), " "),
                                           normalizers.Lowercase()])
    bpe.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"""'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+"""),
                             behavior="removed", invert=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False)])
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=CLIP_SPECIALS, show_progress=False,
                                  end_of_word_suffix="</w>",
                                  initial_alphabet=alphabet + [c + "</w>" for c in alphabet])
    bpe.train_from_iterator(_corpus(), trainer)
    model = json.loads(bpe.to_str())["model"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    return CLIPTokenizer(vocab=model["vocab"], merges=merges, model_max_length=CLIP_MAX_LENGTH)


def train_t5_tokenizer(vocab_size: int = 300):
    """A T5 tokenizer (unigram pieces, `▁` word starts) trained on the tiny corpus."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import T5Tokenizer

    unigram = Tokenizer(models.Unigram())
    unigram.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")])
    trainer = trainers.UnigramTrainer(vocab_size=vocab_size, special_tokens=T5_SPECIALS, unk_token="<unk>",
                                      show_progress=False, initial_alphabet=list(_CHARACTERS))
    unigram.train_from_iterator(_corpus(), trainer)
    pieces = [(piece, float(score)) for piece, score in json.loads(unigram.to_str())["model"]["vocab"]]
    return T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=512)


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
    from diffusers import StableDiffusion3Pipeline

    out = Path(out_dir).resolve()
    wanted = {"family": "sd3", "seed": seed, "builder_version": BUILDER_VERSION}
    return write_build(out, wanted, lambda staging: StableDiffusion3Pipeline(**tiny_sd3_components(seed))
                       .save_pretrained(staging), overwrite=overwrite)
