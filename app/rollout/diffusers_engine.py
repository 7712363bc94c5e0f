"""The reference rollout engine on plain diffusers components: the parity oracle for the vllm-omni engine, and the
engine for clusters without vllm-omni (with `merge_lora`, the faster rollout where an adapter is served).

Same protocol, same sample loop (`app.algo.sampling`), same per-sample noise (app/rollout/seeding.py) and the
same Qwen-Image operations (app/models/qwen_image/model.py) as the vllm-omni pipeline. LoRA: a peft adapter on the
diffusers transformer, loaded from tensors with `set_peft_model_state_dict`. One group at a time: a diffusers
pipeline holds per-call state, so requests are serialised.
"""

from __future__ import annotations

import asyncio
import os

import torch

from app.algo.sampling import sample_trajectory
from app.models.family import get_family
from app.models.qwen_image import FAMILY
from app.models.qwen_image import model as qwen_image
from app.rollout.local_engine import LocalEngine
from app.rollout.seeding import draw_seed, sample_generators
from app.types import GenerationRequest, Trajectory


class DiffusersEngine(LocalEngine):
    kind = "diffusers"
    family = FAMILY.name

    def __init__(self, model_path: str | os.PathLike, *, dtype: str = "float32", device: str | None = None,
                 batched_groups: bool = True, compile=None, lora=None, merge_lora: str | None = None,
                 attention_kernels: list[str] | None = None):
        """batched_groups=False samples a group one image at a time (n forwards of batch 1 per step: the
        comparison the benchmark makes); the images are the same either way. compile, lora, merge_lora,
        attention_kernels: `LocalEngine`'s."""
        super().__init__(model_path, dtype=dtype, device=device, compile=compile, lora=lora, merge_lora=merge_lora,
                         attention_kernels=attention_kernels)
        self.batched_groups = batched_groups
        self.pipe = None

    def load_model(self) -> None:
        import diffusers

        pipeline = getattr(diffusers, get_family(self.family).pipeline_class)  # the family's diffusers pipeline
        if self.device.type == "cuda":  # straight to the GPU: a 20B model never sits in host memory
            pipe = pipeline.from_pretrained(self.model_path, dtype=self.dtype, device_map="cuda")
        else:
            pipe = pipeline.from_pretrained(self.model_path, dtype=self.dtype).to(self.device)
        pipe.set_progress_bar_config(disable=True)
        self.pipe = pipe

    def trained_module(self) -> torch.nn.Module:
        return self.pipe.transformer

    @torch.no_grad()
    def _encode(self, text: str) -> tuple[torch.Tensor, torch.Tensor]:
        embeds, mask = self.pipe.encode_prompt(text, device=self.device, num_images_per_prompt=1)
        if mask is None:  # diffusers drops an all-ones mask
            mask = torch.ones(embeds.shape[:2], dtype=torch.long, device=embeds.device)
        return embeds[0], mask[0]  # [S, D], [S]

    def _generate(self, request: GenerationRequest, seed: int) -> Trajectory:
        if request.is_edit:
            raise ValueError(f"image: model.family={self.family} generates from text only; edits need a family "
                             "that edits (docs/model_families.md)")
        if self.batched_groups or request.n == 1:
            return self._generate_group(request, seed)
        return self._generate_per_sample(request, seed)

    @torch.no_grad()
    def _generate_group(self, request: GenerationRequest, seed: int) -> Trajectory:
        pipe, n = self.pipe, request.n
        with self.phases("encode"):
            embeds, mask = self._encode(request.prompt)
            neg_embeds = neg_mask = None
            if request.do_cfg:
                neg_embeds, neg_mask = self._encode(request.negative_prompt)
        generators = sample_generators(seed, request.sample_offset, n)
        x = qwen_image.initial_latents(generators, pipe.transformer.config.in_channels // 4, request.height,
                                       request.width, embeds.dtype, self.device)  # [n, L, 4C]
        timesteps, sigmas = qwen_image.schedule(pipe.scheduler, request.num_inference_steps, x.shape[1])
        v = qwen_image.group_velocity(pipe.transformer, timesteps, embeds, mask, neg_embeds, neg_mask, batch=n,
                                      height=request.height, width=request.width,
                                      guidance_scale=request.guidance_scale, device=self.device, dtype=embeds.dtype)
        with self.phases("denoise"), self.cheaper_ode_steps(request) as cheaper:
            latents, log_probs = sample_trajectory(cheaper(v), x, sigmas, request.step_noise_levels,
                                                   sde_type=request.sde_type, generators=generators)
        with self.phases("decode"):
            images = qwen_image.decode_images(pipe.vae, latents[:, -1].to(x.dtype), request.height, request.width)
        return Trajectory.sampled(
            request, seed=seed, lora_version=self._lora_version, images=images,
            latents=latents.cpu(), log_probs=log_probs.cpu(),
            timesteps=timesteps, sigmas=sigmas, prompt_embeds=embeds.float().cpu(), prompt_mask=mask.long().cpu(),
            negative_prompt_embeds=neg_embeds.float().cpu() if request.do_cfg else None,
            negative_prompt_mask=neg_mask.long().cpu() if request.do_cfg else None)

    def _generate_per_sample(self, request: GenerationRequest, seed: int) -> Trajectory:
        """The group as n groups of one image (image j keeps its generator: sample_offset), joined."""
        parts = [self._generate_group(request.replace(n=1, sample_offset=request.sample_offset + j), seed)
                 for j in range(request.n)]
        first = parts[0]
        return Trajectory.sampled(
            request, seed=seed, lora_version=first.lora_version, images=torch.cat([t.images for t in parts]),
            latents=torch.cat([t.latents for t in parts]), log_probs=torch.cat([t.log_probs for t in parts]),
            timesteps=first.timesteps, sigmas=first.sigmas, prompt_embeds=first.prompt_embeds,
            prompt_mask=first.prompt_mask, negative_prompt_embeds=first.negative_prompt_embeds,
            negative_prompt_mask=first.negative_prompt_mask, conditioning=first.conditioning, family=first.family,
            producer=first.producer)

    async def generate_plain(self, request: GenerationRequest) -> torch.Tensor:
        """Stock diffusers sampling (the pipeline's `__call__`: its scheduler's ODE step, no trajectory) of the same
        group: uint8 [n, H, W, 3]. The baseline for measuring what trajectory recording costs."""
        await self.start()
        seed = request.seed if request.seed is not None else draw_seed()

        def run() -> torch.Tensor:
            with self._lock, torch.no_grad():
                self._apply_staged()
                return self._plain(request, seed)

        return await asyncio.to_thread(run)

    def _plain(self, request: GenerationRequest, seed: int) -> torch.Tensor:
        """The stock pipeline's call for `generate_plain`, under the engine's lock: uint8 images [n, H, W, 3]."""
        out = self.pipe(prompt=request.prompt, negative_prompt=request.negative_prompt, height=request.height,
                        width=request.width, num_inference_steps=request.num_inference_steps,
                        num_images_per_prompt=request.n,
                        generator=sample_generators(seed, request.sample_offset, request.n), output_type="pt",
                        **self.plain_guidance(request))
        return (out.images.clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu()

    def plain_guidance(self, request: GenerationRequest) -> dict:
        """The stock pipeline's guidance arguments for `request` (`generate_plain`)."""
        return {"true_cfg_scale": request.guidance_scale}

    async def close(self) -> None:
        self.pipe = None
        await super().close()
