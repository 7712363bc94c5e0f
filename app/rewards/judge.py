"""A VLM judge as a reward term (`vlm_judge`): a Qwen2.5-VL or Qwen3-VL from a local folder (transformers'
`AutoModelForImageTextToText` and `AutoProcessor`; nothing is downloaded), asked one question about each image.

- `ocr`: "What text does this image show?", answered greedily, then scored as the OCR term scores rapidocr's
  reading (app/rewards/ocr.py: the prompt's quoted text, normalised edit distance). Greedy, so the same image always
  scores the same (verl-omni samples its judge at temperature 0.7: a noisy reward).
- `yesno`: VQAScore's question, 'Does this image show "{prompt}"? Answer Yes or No.', scored by the first answer
  token: P(Yes) / (P(Yes) + P(No)) from one forward over the question (no generation, nothing to parse). The two
  answers' share, not P(Yes) alone, so that mass on other first tokens ("yes", "The") does not lower the score.

The judge runs on transformers in the reward replica's process, on its GPU in bf16 when it holds one, else on CPUs
in fp32, `batch_size` images a forward (left-padded: a score does not depend on its batch). vllm's engine might
serve a large judge faster on GPUs (not measured); it is not used because a reward replica must also run on the CPU
machines, where vllm serves only the diffusion model.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from app.rewards.ocr import ocr_score, target_text

MODES = ("ocr", "yesno")
OCR_QUESTION = "What text does this image show? Answer with the text only."
YESNO_QUESTION = 'Does this image show "{}"? Answer Yes or No.'


def _answer_token(tokenizer, word: str, key: str) -> int:
    ids = tokenizer.encode(word, add_special_tokens=False)
    if len(ids) != 1:
        raise ValueError(f"{key}: the judge's tokenizer splits {word!r} into {len(ids)} tokens; yesno needs a judge "
                         "whose vocabulary holds Yes and No as single tokens (Qwen2.5-VL, Qwen3-VL)")
    return ids[0]


class VlmJudgeReward:
    name = "vlm_judge"

    def __init__(self, path: str | None, *, mode: str = "ocr", batch_size: int = 8, max_new_tokens: int = 32,
                 device: str | None = None, dtype: str | None = None, key: str = "reward.vlm_judge"):
        import torch
        from transformers import AutoModelForImageTextToText, AutoProcessor
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        if mode not in MODES:
            raise ValueError(f"{key}.mode={mode!r}: one of {MODES}")
        if path is None:
            raise ValueError(f"{key}.path is not set: give the local folder of a Qwen2.5-VL or Qwen3-VL judge")
        folder = Path(path).expanduser()
        if not (folder / "config.json").is_file():
            raise ValueError(f"{key}.path={path}: not the folder of a transformers model (no config.json there)")
        if max_new_tokens < 1:
            raise ValueError(f"{key}.max_new_tokens={max_new_tokens}: at least 1")
        self.mode, self.batch_size, self.max_new_tokens = mode, max(1, int(batch_size)), max_new_tokens
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.dtype = getattr(torch, dtype) if dtype else (torch.bfloat16 if self.device.type == "cuda" else
                                                          torch.float32)
        self.processor = AutoProcessor.from_pretrained(folder)
        self.processor.tokenizer.padding_side = "left"  # the answer starts right after every question
        if getattr(self.processor, "chat_template", None) is None:
            raise ValueError(f"{key}.path={path}: the processor has no chat template (chat_template.jinja)")
        self.model = AutoModelForImageTextToText.from_pretrained(folder, dtype=self.dtype).eval().to(self.device)
        if mode == "yesno":
            self.yes_no = [_answer_token(self.processor.tokenizer, w, f"{key}.mode=yesno") for w in ("Yes", "No")]

    def _inputs(self, images: np.ndarray, questions: list[str]):
        from PIL import Image

        texts = [self.processor.apply_chat_template(
            [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": q}]}],
            add_generation_prompt=True, tokenize=False) for q in questions]
        batch = self.processor(text=texts, images=[Image.fromarray(im) for im in images], padding=True,
                               return_tensors="pt")
        return {k: (v.to(self.device, self.dtype) if v.is_floating_point() else v.to(self.device))
                for k, v in batch.items()}

    def _read(self, images: np.ndarray) -> list[str]:
        import torch

        inputs = self._inputs(images, [OCR_QUESTION] * len(images))
        with torch.no_grad():
            out = self.model.generate(**inputs, max_new_tokens=self.max_new_tokens, do_sample=False)
        new = out[:, inputs["input_ids"].shape[1]:]
        return [t.strip() for t in self.processor.batch_decode(new, skip_special_tokens=True)]

    def _yes(self, images: np.ndarray, prompts: list[str]) -> list[float]:
        import torch

        inputs = self._inputs(images, [YESNO_QUESTION.format(p) for p in prompts])
        with torch.no_grad():
            logits = self.model(**inputs).logits[:, -1, self.yes_no].float()
        return [float(p) for p in torch.softmax(logits, dim=-1)[:, 0].cpu()]

    def score_and_read(self, images: np.ndarray, prompts: Sequence[str]) -> tuple[list[float], list[str]]:
        """(scores, what the judge answered: the text it read; in yesno mode, Yes or No by the larger share)."""
        scores: list[float] = []
        answers: list[str] = []
        for start in range(0, len(images), self.batch_size):
            chunk, asked = images[start:start + self.batch_size], list(prompts[start:start + self.batch_size])
            if self.mode == "ocr":
                read = self._read(chunk)
                scores += [ocr_score(text, target_text(p)) for text, p in zip(read, asked, strict=True)]
                answers += read
            else:
                yes = self._yes(chunk, asked)
                scores += yes
                answers += ["Yes" if p >= 0.5 else "No" for p in yes]
        return scores, answers

    def score(self, images: np.ndarray, prompts: Sequence[str]) -> list[float]:
        return self.score_and_read(images, prompts)[0]
