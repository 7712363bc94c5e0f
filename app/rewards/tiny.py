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
