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


def build_tiny_clip(out: str | Path, *, seed: int = 0, overwrite: bool = False) -> Path:
    """A tiny CLIPModel + CLIPProcessor at `out`, and its aesthetic head (`out/aesthetic_head.pth`)."""
    import torch
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor

    from app.models.sd3.tiny import CLIP_MAX_LENGTH, train_clip_tokenizer

    def save(folder: Path) -> None:
        tokenizer = train_clip_tokenizer()
        bos, eos = (tokenizer.convert_tokens_to_ids(t) for t in ("<|startoftext|>", "<|endoftext|>"))
        config = CLIPConfig(
            text_config=dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=2, max_position_embeddings=CLIP_MAX_LENGTH, bos_token_id=bos,
                             eos_token_id=eos, pad_token_id=eos),
            vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                               image_size=IMAGE_SIZE, patch_size=8),
            projection_dim=PROJECTION)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = CLIPModel(config).eval()
            # LAION's aesthetic MLP: linear layers at 0, 2, 4, 6, 7 (dropouts between), here 16 → 32 → 16 → 8 → 4 → 1
            widths = [PROJECTION, 32, 16, 8, 4, 1]
            head = {}
            for index, (fan_in, fan_out) in zip([0, 2, 4, 6, 7], zip(widths, widths[1:], strict=False), strict=True):
                layer = torch.nn.Linear(fan_in, fan_out)
                head[f"layers.{index}.weight"], head[f"layers.{index}.bias"] = layer.weight.data, layer.bias.data
        model.save_pretrained(folder)
        images = CLIPImageProcessor(size={"shortest_edge": IMAGE_SIZE},
                                    crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
        CLIPProcessor(image_processor=images, tokenizer=tokenizer).save_pretrained(folder)
        torch.save(head, folder / AESTHETIC_HEAD)

    return write_build(Path(out), {"tiny": "clip", "seed": seed, "version": BUILD_VERSION}, save, overwrite=overwrite)


# Qwen2.5-VL's chat format, reduced to what a judge sends (the real folders ship their own template)
JUDGE_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}{% else %}{% for part in message['content'] %}{% if part['type'] == 'image' %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
JUDGE_PIXELS = 56 * 56  # the processor resizes every image to at most this many pixels: 4 patches of 28 px


def build_tiny_judge(out: str | Path, *, seed: int = 0, overwrite: bool = False) -> Path:
    """A tiny Qwen2.5-VL (`Qwen2_5_VLForConditionalGeneration`) with its processor and chat template at `out`: the
    project's Qwen2 tokenizer, plus "Yes" and "No" as single tokens as a real judge's vocabulary has them."""
    import torch
    from transformers import (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLProcessor,
                              Qwen2VLImageProcessor, Qwen2VLVideoProcessor)

    from app.models.builds import SPECIAL_TOKENS, train_tokenizer

    def save(folder: Path) -> None:
        tokenizer = train_tokenizer()
        tokenizer.add_tokens(["Yes", "No"])
        ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(
                text_config=dict(
                    vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=2048,
                    bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"],
                    pad_token_id=ids["<|endoftext|>"],
                    rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0, "mrope_section": [2, 3, 3]}),
                vision_config=dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=32,
                                   fullatt_block_indexes=[0]),
                vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
                image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"])).eval()
        model.generation_config.pad_token_id = ids["<|endoftext|>"]
        model.save_pretrained(folder)
        images = Qwen2VLImageProcessor(min_pixels=JUDGE_PIXELS, max_pixels=JUDGE_PIXELS)
        Qwen2_5_VLProcessor(image_processor=images, tokenizer=tokenizer, video_processor=Qwen2VLVideoProcessor(),
                            chat_template=JUDGE_CHAT_TEMPLATE).save_pretrained(folder)

    return write_build(Path(out), {"tiny": "qwen2.5-vl judge", "seed": seed, "version": BUILD_VERSION}, save,
                       overwrite=overwrite)
