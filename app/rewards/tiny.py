"""Tiny random reward models, built here (nothing is downloaded), with the real ones' architectures and files: a
transformers `CLIPModel` folder (weights, `CLIPProcessor` files, a CLIP tokenizer learnt from the tiny corpus) for
`pickscore` and `clipscore`, and beside it an aesthetic head of the LAION predictor's layout for `aesthetic`.
Same seed → identical tensors. The tests and the CPU configs read them exactly as real weights are read.

    python -m jobs.make_tiny_models --preset tiny-clip --out .cache/tiny-clip
"""

from __future__ import annotations

from pathlib import Path

from app.models.builds import write_build

IMAGE_SIZE = 32  # the processor resizes and crops every image to this
PROJECTION = 16  # the joint embedding (the aesthetic head's input)
AESTHETIC_HEAD = "aesthetic_head.pth"
BUILD_VERSION = 1


# the real sizes (random weights, for the GPU benches): PickScore_v1 is a CLIP ViT-H/14, its text tower 1024 wide
CLIP_H = dict(text=dict(vocab_size=49408, hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                        num_attention_heads=16),
              vision=dict(hidden_size=1280, intermediate_size=5120, num_hidden_layers=32, num_attention_heads=16,
                          image_size=224, patch_size=14),
              projection=1024, head=[1024, 1024, 128, 64, 16, 1])
CLIP_TINY = dict(text=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2),
                 vision=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                             image_size=IMAGE_SIZE, patch_size=8),
                 projection=PROJECTION, head=[PROJECTION, 32, 16, 8, 4, 1])


def build_tiny_clip(out: str | Path, *, seed: int = 0, overwrite: bool = False) -> Path:
    """A tiny CLIPModel + CLIPProcessor at `out`, and its aesthetic head (`out/aesthetic_head.pth`)."""
    return _build_clip(out, CLIP_TINY, {"tiny": "clip", "seed": seed, "version": BUILD_VERSION}, seed, overwrite)


def build_full_clip(out: str | Path, *, seed: int = 0, overwrite: bool = False) -> Path:
    """PickScore's size (CLIP ViT-H/14, 986M parameters), random bf16 weights, the tiny tokenizer: throughput only."""
    return _build_clip(out, CLIP_H, {"random": "clip-vit-h-14", "seed": seed, "version": BUILD_VERSION}, seed,
                       overwrite, dtype="bfloat16")


def _build_clip(out: str | Path, sizes: dict, wanted: dict, seed: int, overwrite: bool, dtype: str | None = None):
    import torch
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor

    from app.models.sd3.tiny import CLIP_MAX_LENGTH, train_clip_tokenizer

    def save(folder: Path) -> None:
        tokenizer = train_clip_tokenizer()
        bos, eos = (tokenizer.convert_tokens_to_ids(t) for t in ("<|startoftext|>", "<|endoftext|>"))
        image_size = sizes["vision"]["image_size"]
        config = CLIPConfig(
            text_config=dict({"vocab_size": len(tokenizer)}, **sizes["text"], max_position_embeddings=CLIP_MAX_LENGTH,
                             bos_token_id=bos, eos_token_id=eos, pad_token_id=eos),
            vision_config=sizes["vision"], projection_dim=sizes["projection"])
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = CLIPModel(config).eval()
            # LAION's aesthetic MLP: linear layers at 0, 2, 4, 6, 7 (dropouts between); tiny 16 → 32 → 16 → 8 → 4 → 1
            widths = sizes["head"]
            head = {}
            for index, (fan_in, fan_out) in zip([0, 2, 4, 6, 7], zip(widths, widths[1:], strict=False), strict=True):
                layer = torch.nn.Linear(fan_in, fan_out)
                head[f"layers.{index}.weight"], head[f"layers.{index}.bias"] = layer.weight.data, layer.bias.data
        if dtype:
            model = model.to(getattr(torch, dtype))
        model.save_pretrained(folder)
        images = CLIPImageProcessor(size={"shortest_edge": image_size},
                                    crop_size={"height": image_size, "width": image_size})
        CLIPProcessor(image_processor=images, tokenizer=tokenizer).save_pretrained(folder)
        torch.save(head, folder / AESTHETIC_HEAD)

    return write_build(Path(out), wanted, save, overwrite=overwrite)

# Qwen2.5-VL's chat format, reduced to what a judge sends (the real folders ship their own template)
JUDGE_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}{% else %}{% for part in message['content'] %}{% if part['type'] == 'image' %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
JUDGE_PIXELS = 56 * 56  # the processor resizes every image to at most this many pixels: 4 patches of 28 px


# Qwen2.5-VL-3B-Instruct's sizes (random weights, for the GPU benches), and the tiny judge's
JUDGE_3B = dict(text=dict(vocab_size=151936, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                          num_attention_heads=16, num_key_value_heads=2, max_position_embeddings=128000,
                          tie_word_embeddings=True),
                vision=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=2048,
                            fullatt_block_indexes=[7, 15, 23, 31]),
                mrope=[16, 24, 24], pixels=None)
JUDGE_TINY = dict(text=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                            num_key_value_heads=2, max_position_embeddings=2048),
                  vision=dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=32,
                              fullatt_block_indexes=[0]),
                  mrope=[2, 3, 3], pixels=JUDGE_PIXELS)


def build_tiny_judge(out: str | Path, *, seed: int = 0, overwrite: bool = False) -> Path:
    """A tiny Qwen2.5-VL (`Qwen2_5_VLForConditionalGeneration`) with its processor and chat template at `out`: the
    project's Qwen2 tokenizer, plus "Yes" and "No" as single tokens as a real judge's vocabulary has them."""
    return _build_judge(out, JUDGE_TINY, {"tiny": "qwen2.5-vl judge", "seed": seed, "version": BUILD_VERSION}, seed,
                        overwrite)


def build_full_judge(out: str | Path, *, seed: int = 0, overwrite: bool = False) -> Path:
    """Qwen2.5-VL-3B's size (3.8B parameters), random bf16 weights drawn on the GPU where there is one, the tiny
    tokenizer and the processor's default resolution (a 512² image is 324 visual tokens): throughput only."""
    return _build_judge(out, JUDGE_3B, {"random": "qwen2.5-vl-3b judge", "seed": seed, "version": BUILD_VERSION},
                        seed, overwrite, dtype="bfloat16")


def _build_judge(out: str | Path, sizes: dict, wanted: dict, seed: int, overwrite: bool, dtype: str | None = None):
    import torch
    from transformers import (
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2_5_VLProcessor,
        Qwen2VLImageProcessor,
        Qwen2VLVideoProcessor,
    )

    from app.models.builds import SPECIAL_TOKENS, train_tokenizer

    def save(folder: Path) -> None:
        tokenizer = train_tokenizer()
        tokenizer.add_tokens(["Yes", "No"])
        ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
        text = dict({"vocab_size": len(tokenizer)}, **sizes["text"])
        config = Qwen2_5_VLConfig(
            text_config=dict(text, bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"],
                             pad_token_id=ids["<|endoftext|>"],
                             rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0,
                                              "mrope_section": sizes["mrope"]}),
            vision_config=sizes["vision"],
            vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
            image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"])
        # a real-size build is drawn on the GPU (minutes of CPU otherwise); the tiny one on the CPU, as always
        device = "cuda" if dtype and torch.cuda.is_available() else "cpu"
        with torch.random.fork_rng(devices=[]), torch.device(device):
            torch.manual_seed(seed)
            model = Qwen2_5_VLForConditionalGeneration(config).eval()
        if dtype:
            model = model.to(getattr(torch, dtype))
        model.generation_config.pad_token_id = ids["<|endoftext|>"]
        model.save_pretrained(folder)
        pixels = {"min_pixels": sizes["pixels"], "max_pixels": sizes["pixels"]} if sizes["pixels"] else {}
        Qwen2_5_VLProcessor(image_processor=Qwen2VLImageProcessor(**pixels), tokenizer=tokenizer,
                            video_processor=Qwen2VLVideoProcessor(),
                            chat_template=JUDGE_CHAT_TEMPLATE).save_pretrained(folder)

    return write_build(Path(out), wanted, save, overwrite=overwrite)
