"""A BAGEL group's conditioning: what a request turns into (token ids, an edit's encoded input image), how the
CFG contexts are built from it, and the re-scoring of a stored trajectory (the trainer's side).

The conditioning is a flat dict of tensors, stored in `Trajectory.conditioning`:

    prompt_ids      int64 [S]    the prompt as BAGEL's LLM reads it: <|im_start|> text <|im_end|>
    negative_ids    int64 [S']   the negative prompt's (absent: the empty context, upstream's default)
    image_tokens    int64 [2]    ids of <|vision_start|> and <|vision_end|>
    edit_latents    fp32 [N, 64] an edit's input image, encoded by the autoencoder and patchified (edits only)
    edit_grid       int64 [2]    its latent grid (h, w)
    edit_vit        fp32 [3, H, W] the same image as the ViT sees it (SigLIP preprocessing, in [-1, 1])

The contexts follow vllm-omni 0.30's single-stage BAGEL pipeline:
- text to image: full = prompt; text-unconditional = negative prompt (or empty); image-unconditional = full
  (image CFG then sharpens the text guidance, as vllm-omni computes it);
- edit: full = [input image through the generation expert, its ViT tokens, prompt]; text-unconditional = the
  image blocks (+ negative prompt); image-unconditional = the prompt alone.

Text contexts depend only on the frozen understanding expert; an edit's image block runs through the generation
expert, so the trainer rebuilds it under the current LoRA (`score_trajectory`).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
from PIL import Image

from app.algo.sampling import score_steps
from app.models.bagel.model import BagelMoT, Context, Contexts, Guidance, group_velocity, patchify

BOS, EOS = "<|im_start|>", "<|im_end|>"
IMAGE_START, IMAGE_END = "<|vision_start|>", "<|vision_end|>"


def token_ids(tokenizer, text: str) -> torch.Tensor:
    """BAGEL's prompt ids: bos + text (no special tokens of the tokenizer's own) + eos; a prompt that arrives
    already wrapped is not wrapped twice (vllm-omni strips the wrappers)."""
    text = text.removeprefix(BOS).removesuffix(EOS)
    ids = tokenizer.encode(text, add_special_tokens=False)
    return torch.tensor([tokenizer.convert_tokens_to_ids(BOS), *ids, tokenizer.convert_tokens_to_ids(EOS)])


def image_token_ids(tokenizer) -> torch.Tensor:
    return torch.tensor([tokenizer.convert_tokens_to_ids(IMAGE_START), tokenizer.convert_tokens_to_ids(IMAGE_END)])


def text_conditioning(tokenizer, prompt: str, negative_prompt: str | None) -> dict[str, torch.Tensor]:
    """prompt_ids, negative_ids (only for a non-empty negative prompt) and image_tokens."""
    out = {"prompt_ids": token_ids(tokenizer, prompt), "image_tokens": image_token_ids(tokenizer)}
    if negative_prompt:
        out["negative_ids"] = token_ids(tokenizer, negative_prompt)
    return out


def edit_input_size(width: int, height: int, *, stride: int, max_latent_size: int) -> tuple[int, int]:
    """(width, height) an edit's input image is resized to (vllm-omni's rule): at most the checkpoint's largest
    image on its long side, at least min(256, that) on its short side, both rounded to the latent stride."""
    max_side = max_latent_size * stride
    scale = min(max_side / max(width, height), 1.0)
    scale = max(scale, min(256, max_side) / min(width, height))
    new_w = min(max(stride, round(width * scale / stride) * stride), max_side)
    new_h = min(max(stride, round(height * scale / stride) * stride), max_side)
    return new_w, new_h


def edit_conditioning(image: torch.Tensor, *, autoencoder, autoencoder_params: dict, image_processor,
                      stride: int, max_latent_size: int, latent_patch: int = 2) -> dict[str, torch.Tensor]:
    """An edit's input image (uint8 [H, W, 3]) as edit_latents, edit_grid and edit_vit (see the module doc)."""
    from app.models.bagel.flux_ae import encode

    picture = Image.fromarray(image.numpy())
    size = edit_input_size(picture.width, picture.height, stride=stride, max_latent_size=max_latent_size)
    if size != picture.size:
        picture = picture.resize(size, Image.BICUBIC)
    pixels = torch.from_numpy(_array(picture)).float().permute(2, 0, 1) / 127.5 - 1.0  # [3, H, W] in [-1, 1]
    device = next(autoencoder.parameters()).device
    latent = encode(autoencoder, pixels[None].to(device), autoencoder_params)[0].float().cpu()  # [z, H/8, W/8]
    grid = (latent.shape[1] // latent_patch, latent.shape[2] // latent_patch)
    vit = image_processor(images=picture, return_tensors="pt").pixel_values[0].float()
    return {"edit_latents": patchify(latent, latent_patch), "edit_grid": torch.tensor(grid),
            "edit_vit": vit}


def _array(picture: Image.Image):
    import numpy as np

    return np.asarray(picture.convert("RGB")).copy()


def is_edit(conditioning: dict[str, torch.Tensor]) -> bool:
    return "edit_latents" in conditioning


# layer passes of building a group's contexts (image block, ViT block, prompt, negative prompt, prompt alone),
# with CFG and without: `build_contexts(..., uniform=True)` always makes this many (see there)
UNIFORM_PASSES = {True: 5, False: 3}


def build_contexts(model: BagelMoT, conditioning: dict[str, torch.Tensor], guidance: Guidance, *,
                   uniform: bool = False) -> Contexts:
    """The group's CFG contexts (only those its guidance uses), built by `model` as it stands (adapter on or off;
    differentiable unless under no_grad).

    uniform: make the same number of passes through the layers whatever the group (text or edit, a negative
    prompt or not; padded with one-token passes), and give the image-unconditional branch of text to image its own
    forward instead of reusing the conditional one. Under FSDP2 every layer pass is a collective, so every rank must
    make as many as the others, whichever groups it holds."""
    if uniform:
        counted = _CountedPasses(model)
        contexts = build_contexts(counted, conditioning, guidance)
        padding = UNIFORM_PASSES[guidance.text_scale > 1.0] - counted.passes
        for _ in range(padding):
            model.prefill_text(conditioning["prompt_ids"][:1].to(next(model.parameters()).device))
        if contexts.image_uncond is contexts.full:
            contexts.image_uncond = Context(contexts.full.layers, contexts.full.position)
        return contexts
    param = next(model.parameters())
    device, dtype = param.device, param.dtype
    marks = tuple(int(i) for i in conditioning["image_tokens"])
    prompt = conditioning["prompt_ids"].to(device)
    negative = conditioning.get("negative_ids")
    cfg = guidance.text_scale > 1.0
    if not is_edit(conditioning):
        full = model.prefill_text(prompt)
        if not cfg:
            return Contexts(full)
        text_uncond = model.prefill_text(negative.to(device)) if negative is not None else Context.empty()
        return Contexts(full, text_uncond, full if guidance.img_scale > 1.0 else None)
    grid = tuple(int(v) for v in conditioning["edit_grid"])
    image = model.extend_with_image(None, conditioning["edit_latents"][None].to(device, dtype), grid, marks)
    image = model.extend_with_vit(image, conditioning["edit_vit"].to(device, dtype), marks)
    full = model.prefill_text(prompt, image)
    if not cfg:
        return Contexts(full)
    text_uncond = model.prefill_text(negative.to(device), image) if negative is not None else image
    image_uncond = model.prefill_text(prompt) if guidance.img_scale > 1.0 else None
    return Contexts(full, text_uncond, image_uncond)


class _CountedPasses:
    """A BagelMoT seen by `build_contexts`, counting the context passes it makes."""

    def __init__(self, model: BagelMoT):
        self.model, self.passes = model, 0

    def parameters(self):
        return self.model.parameters()

    def __getattr__(self, name):
        method = getattr(self.model, name)
        if name not in ("prefill_text", "extend_with_image", "extend_with_vit"):
            return method

        def counted(*args, **kwargs):
            self.passes += 1
            return method(*args, **kwargs)

        return counted


def trajectory_guidance(traj) -> Guidance:
    """The guidance a trajectory was sampled with."""
    return Guidance(text_scale=traj.guidance_scale, img_scale=traj.image_guidance_scale,
                    interval=tuple(traj.cfg_interval), renorm=traj.cfg_renorm, renorm_min=traj.cfg_renorm_min)


def latent_grid(model: BagelMoT, height: int, width: int) -> tuple[int, int]:
    """The latent token grid (h, w) of an image: one token per autoencoder-downsampling x latent-patch pixels."""
    stride = model.config.vae_downsample * model.config.latent_patch_size
    return height // stride, width // stride


def score_trajectory(model: BagelMoT, traj, steps: Sequence[int], samples: Sequence[int], *,
                     flow_grpo_compat: bool = False, uniform: bool = False) -> list:
    """Re-score a BAGEL trajectory's transitions at `steps` for group members `samples` under `model` as it
    stands: the contexts are rebuilt from the stored conditioning, then `app.algo.sampling.score_steps`.

    The contexts are rebuilt under the current adapter but not differentiated: the policy gradient flows through
    the velocity of the image being generated. (A text context does not depend on the adapter at all; an edit's
    image block does, in value, through the generation expert.) `uniform`: see `build_contexts` (FSDP2)."""
    guidance = trajectory_guidance(traj)
    with torch.no_grad():
        contexts = build_contexts(model, traj.conditioning, guidance, uniform=uniform)
    marks = tuple(int(i) for i in traj.conditioning["image_tokens"])
    param = next(model.parameters())
    velocity = group_velocity(model, contexts, guidance, sigmas=traj.sigmas,
                              grid=latent_grid(model, traj.height, traj.width), image_tokens=marks)
    return score_steps(velocity, traj.latents[list(samples)], steps, traj.sigmas, traj.step_noise_levels,
                       sde_type=traj.sde_type, flow_grpo_compat=flow_grpo_compat, device=param.device,
                       dtype=param.dtype)


@functools.cache
def tokenizer_of(path: str):
    """BAGEL's tokenizer (`Qwen2Tokenizer`: AutoTokenizer would read config.json's model type), read once per
    checkpoint: the prompt checker and the bench's shaped groups share it."""
    from transformers import Qwen2Tokenizer

    return Qwen2Tokenizer.from_pretrained(path)


def shaped_trajectory(path, request, config, generator: torch.Generator, text_tokens: int = 64):
    """A text-to-image group shaped as the BAGEL engine returns it for `request`, random values (benchmarks: the
    cost does not depend on them): `text_tokens` prompt ids (and as many negative ones under CFG), the latents of
    every step, BAGEL's schedule. `config`: the model's (`BagelMoT.config`). Edits are not shaped (their image
    blocks would need the autoencoder and the ViT)."""
    from app.models.bagel.model import schedule
    from app.types import Trajectory

    if request.is_edit:
        raise ValueError("shaped_trajectory: BAGEL edits are not shaped; bench a text-to-image request")
    tokenizer = tokenizer_of(str(path))
    stride = config["vae_downsample"] * config["latent_patch_size"]
    tokens = (request.height // stride) * (request.width // stride)
    channels = config["latent_patch_size"] ** 2 * config["latent_channels"]
    n, steps = request.n, request.num_inference_steps

    def ids():
        return torch.randint(len(tokenizer), (text_tokens,), generator=generator)

    conditioning = {"prompt_ids": ids(), "image_tokens": image_token_ids(tokenizer)}
    if request.do_cfg and request.negative_prompt:
        conditioning["negative_ids"] = ids()
    sigmas = schedule(steps + 1, request.timestep_shift)
    return Trajectory.sampled(
        request, seed=request.seed, lora_version=0, family="bagel",
        images=torch.zeros(n, request.height, request.width, 3, dtype=torch.uint8),
        latents=torch.randn(n, steps + 1, tokens, channels, generator=generator), log_probs=torch.zeros(n, steps),
        timesteps=sigmas[:-1].clone(), sigmas=sigmas, conditioning=conditioning)
