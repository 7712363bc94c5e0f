"""CLIP-type rewards: PickScore, CLIPScore and the LAION aesthetic score, from a transformers `CLIPModel` in a local
folder (nothing is downloaded).

- `pickscore`: PickScore_v1 (CLIP ViT-H/14 fine-tuned on Pick-a-Pic) as flow_grpo scores it, written from its
  description: logit_scale · cos(image, prompt) / 26, where 26 brings a typical score near 1. Its weights ship
  without a processor; CLIP-ViT-H-14-laion2B's processor files go in the same folder or in `processor_path`.
- `clipscore`: CLIP-S of Hessel et al. (2021) with CLIP ViT-L/14: 2.5 · max(cos(image, prompt), 0).
- `aesthetic`: the LAION improved-aesthetic predictor: an MLP head (`head_path`, the `sac+logos+ava1-l14-linearMSE`
  state dict: five linear layers, 768 → 1 at real size) on CLIP ViT-L/14's normalised image embedding; the prompt is
  not read.

The images are scored in batches of `batch_size` in the replica's process: on its GPU in bf16 when it holds one,
else on CPUs in fp32 (`device`, `dtype`). Prompts are padded to CLIP's context (77 tokens), so a score does not
depend on what else is in its batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

KINDS = ("pickscore", "clipscore", "aesthetic")
PICKSCORE_SCALE = 26.0  # flow_grpo's normalisation of logit_scale · cos
CLIPSCORE_WEIGHT = 2.5  # CLIP-S's w


def _folder(path, key: str) -> Path:
    if path is None:
        raise ValueError(f"{key} is not set: give the local folder of a transformers CLIPModel")
    folder = Path(path).expanduser()
    if not (folder / "config.json").is_file():
        raise ValueError(f"{key}={path}: not the folder of a transformers CLIPModel (no config.json there)")
    return folder


def aesthetic_head(state: dict):
    """The LAION aesthetic MLP for a state dict of `layers.{0,2,4,6,7}.{weight,bias}` (its dropouts are the odd
    indices): the widths come from the weights, so a tiny head loads as the real one does."""
    import torch

    linear = sorted({int(k.split(".")[1]) for k in state if k.startswith("layers.")})
    modules: list[torch.nn.Module] = []
    for i in range(max(linear) + 1):
        if i in linear:
            out_features, in_features = state[f"layers.{i}.weight"].shape
            modules.append(torch.nn.Linear(in_features, out_features))
        else:
            modules.append(torch.nn.Dropout(0.0))
    head = torch.nn.Sequential(*modules)
    head.load_state_dict({k.removeprefix("layers."): v for k, v in state.items()})
    return head.eval()


class ClipReward:
    """One of `KINDS`; `key` names the config section in error messages (e.g. reward.pickscore)."""

    def __init__(self, kind: str, path: str | None, *, processor_path: str | None = None,
                 head_path: str | None = None, device: str | None = None, dtype: str | None = None,
                 batch_size: int = 16, key: str | None = None):
        import torch
        from transformers import CLIPModel, CLIPProcessor
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # a replica's log is no place for "Loading weights" bars
        if kind not in KINDS:
            raise ValueError(f"unknown CLIP reward {kind!r}: one of {KINDS}")
        key = key or f"reward.{kind}"
        self.name, self.kind, self.batch_size = kind, kind, max(1, int(batch_size))
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.dtype = getattr(torch, dtype) if dtype else (torch.bfloat16 if self.device.type == "cuda" else
                                                          torch.float32)
        folder = _folder(path, f"{key}.path")
        processor = Path(processor_path).expanduser() if processor_path else folder
        if not any((processor / name).is_file() for name in ("preprocessor_config.json", "processor_config.json")):
            raise ValueError(f"{key}.processor_path={processor}: no CLIP processor there (preprocessor_config.json "
                             "or processor_config.json; PickScore_v1 uses CLIP-ViT-H-14-laion2B-s32B-b79K's)")
        self.model = CLIPModel.from_pretrained(folder, dtype=self.dtype).eval().to(self.device)
        self.processor = CLIPProcessor.from_pretrained(processor)
        self.head = None
        if kind == "aesthetic":
            if head_path is None or not Path(head_path).expanduser().is_file():
                raise ValueError(f"{key}.head_path={head_path}: no aesthetic head there (the MLP's state dict, "
                                 "sac+logos+ava1-l14-linearMSE.pth)")
            state = torch.load(Path(head_path).expanduser(), map_location="cpu", weights_only=True)
            self.head = aesthetic_head(state).to(self.device, torch.float32)

    def score(self, images: np.ndarray, prompts: Sequence[str]) -> list[float]:
        """images: uint8 [n, H, W, 3]; one score per image, higher is better."""
        out: list[float] = []
        for start in range(0, len(images), self.batch_size):
            out += self._score(images[start:start + self.batch_size], list(prompts[start:start + self.batch_size]))
        return out

    def _embeddings(self, images: np.ndarray, prompts: list[str] | None):
        import torch

        pixels = self.processor(images=list(images), return_tensors="pt")["pixel_values"]
        # transformers 5: the projected embedding is the output's pooler_output
        image = self.model.get_image_features(pixel_values=pixels.to(self.device, self.dtype)).pooler_output.float()
        image = image / image.norm(dim=-1, keepdim=True)
        if prompts is None:
            return image, None
        tokens = self.processor(text=prompts, padding="max_length", truncation=True,
                                max_length=self.processor.tokenizer.model_max_length, return_tensors="pt")
        text = self.model.get_text_features(input_ids=tokens["input_ids"].to(self.device),
                                            attention_mask=tokens["attention_mask"].to(self.device)).pooler_output
        text = text.float()
        return image, text / torch.linalg.vector_norm(text, dim=-1, keepdim=True)

    def _score(self, images: np.ndarray, prompts: list[str]) -> list[float]:
        import torch

        with torch.no_grad():
            image, text = self._embeddings(images, None if self.kind == "aesthetic" else prompts)
            if self.kind == "aesthetic":
                scores = self.head(image).squeeze(-1)
            else:
                cos = (image * text).sum(dim=-1)
                if self.kind == "pickscore":
                    scores = self.model.logit_scale.exp().float() * cos / PICKSCORE_SCALE
                else:
                    scores = CLIPSCORE_WEIGHT * cos.clamp(min=0)
        return [float(s) for s in scores.cpu()]
