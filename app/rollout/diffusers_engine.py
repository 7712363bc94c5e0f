"""The reference rollout engine on plain diffusers components: the parity oracle for the vllm-omni engine, and the
engine where vllm cannot be installed (the lent GPU machine).

Same protocol, same sampler (`app.algo.sde.sde_step`), same per-sample noise (app/rollout/seeding.py) and the
same Qwen-Image operations (app/models/qwen_image.py) as the vllm-omni pipeline. LoRA: a peft adapter on the
diffusers transformer, loaded from tensors with `set_peft_model_state_dict`. One group at a time: a diffusers
pipeline holds per-call state, so requests are serialised.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from pathlib import Path

import torch

from app.algo.sde import sde_step
from app.models import qwen_image
from app.models.lora import ADAPTER_NAME, attach_lora, transformer_key
from app.rollout.seeding import draw_seed, sample_generators
from app.types import GenerationRequest, LoraAdapter, Trajectory


class DiffusersEngine:
    kind = "diffusers"

    def __init__(self, model_path: str | os.PathLike, *, dtype: str = "float32", device: str | None = None,
                 batched_groups: bool = True):
        """batched_groups=False samples a group one image at a time (n forwards of batch 1 per step: the
        comparison the benchmark makes); the images are the same either way."""
        self.model_path = str(Path(model_path).resolve())
        self.batched_groups = batched_groups
        self.dtype = getattr(torch, dtype)
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.pipe = None
        self._lock = threading.Lock()  # one group at a time on the shared modules
        self._lora_version = 0
        self._served = 0
        self._errors = 0

    @property
    def lora_version(self) -> int:
        return self._lora_version

    def load(self) -> None:
        """Load the pipeline onto the device (once; `start` does it off the event loop)."""
        from diffusers import QwenImagePipeline

        with self._lock:
            if self.pipe is None:
                if self.device.type == "cuda":  # straight to the GPU: a 20B model never sits in host memory
                    pipe = QwenImagePipeline.from_pretrained(self.model_path, dtype=self.dtype, device_map="cuda")
                else:
                    pipe = QwenImagePipeline.from_pretrained(self.model_path, dtype=self.dtype).to(self.device)
                pipe.set_progress_bar_config(disable=True)
                self.pipe = pipe

    async def start(self) -> None:
        if self.pipe is None:
            await asyncio.to_thread(self.load)

    @torch.no_grad()
    def _encode(self, text: str) -> tuple[torch.Tensor, torch.Tensor]:
        embeds, mask = self.pipe.encode_prompt(text, device=self.device, num_images_per_prompt=1)
        if mask is None:  # diffusers drops an all-ones mask
            mask = torch.ones(embeds.shape[:2], dtype=torch.long, device=embeds.device)
        return embeds[0], mask[0]  # [S, D], [S]

    @torch.no_grad()
    def _generate(self, request: GenerationRequest, seed: int) -> Trajectory:
        pipe, n = self.pipe, request.n
        embeds, mask = self._encode(request.prompt)
        neg_embeds = neg_mask = None
        if request.do_cfg:
            neg_embeds, neg_mask = self._encode(request.negative_prompt)
        generators = sample_generators(seed, request.sample_offset, n)
        x = qwen_image.initial_latents(generators, pipe.transformer.config.in_channels // 4, request.height,
                                       request.width, embeds.dtype, self.device)  # [n, L, 4C]
        timesteps, sigmas = qwen_image.schedule(pipe.scheduler, request.num_inference_steps, x.shape[1])
        shapes = qwen_image.img_shapes(n, request.height, request.width)

        def batch(embeds, mask):  # the group shares one prompt: [S, D] -> [n, S, D] views
            return embeds.unsqueeze(0).expand(n, -1, -1), mask.unsqueeze(0).expand(n, -1)

        pos_e, pos_m = batch(embeds, mask)
        neg_e, neg_m = batch(neg_embeds, neg_mask) if request.do_cfg else (None, None)
        latents, log_probs = [x.float()], []
        for i in range(request.num_inference_steps):
            v = qwen_image.velocity(pipe.transformer, x, timesteps[i].to(self.device), pos_e, pos_m, shapes,
                                    guidance_scale=request.guidance_scale, negative_prompt_embeds=neg_e,
                                    negative_prompt_mask=neg_m)
            step = sde_step(v, x, sigmas[i], sigmas[i + 1], noise_level=request.noise_level,
                            sde_type=request.sde_type, sigma_max=sigmas[1], generator=generators,
                            sample_dtype=x.dtype)  # scored as rounded: the sample the next step sees
            x = step.prev_sample.to(x.dtype)
            latents.append(x.float())
            log_probs.append(step.log_prob)
        images = qwen_image.decode_images(pipe.vae, x, request.height, request.width)
        return Trajectory.sampled(
            request, seed=seed, lora_version=self._lora_version, images=images,
            latents=torch.stack(latents, dim=1).cpu(), log_probs=torch.stack(log_probs, dim=1).cpu(),
            timesteps=timesteps, sigmas=sigmas, prompt_embeds=embeds.float().cpu(), prompt_mask=mask.long().cpu(),
            negative_prompt_embeds=neg_embeds.float().cpu() if request.do_cfg else None,
            negative_prompt_mask=neg_mask.long().cpu() if request.do_cfg else None,
            producer={"engine": self.kind, "pid": os.getpid()})

    def _generate_per_sample(self, request: GenerationRequest, seed: int) -> Trajectory:
        """The group as n groups of one image (image j keeps its generator: sample_offset), joined."""
        parts = [self._generate(request.replace(n=1, sample_offset=request.sample_offset + j), seed)
                 for j in range(request.n)]
        first = parts[0]
        return Trajectory.sampled(
            request, seed=seed, lora_version=first.lora_version, images=torch.cat([t.images for t in parts]),
            latents=torch.cat([t.latents for t in parts]), log_probs=torch.cat([t.log_probs for t in parts]),
            timesteps=first.timesteps, sigmas=first.sigmas, prompt_embeds=first.prompt_embeds,
            prompt_mask=first.prompt_mask, negative_prompt_embeds=first.negative_prompt_embeds,
            negative_prompt_mask=first.negative_prompt_mask, producer=first.producer)

    def _generate_locked(self, request: GenerationRequest, seed: int) -> Trajectory:
        with self._lock:
            started = time.perf_counter()
            traj = (self._generate if self.batched_groups or request.n == 1 else self._generate_per_sample)(
                request, seed)
            traj.producer["seconds"] = time.perf_counter() - started
            if self.device.type == "cuda":
                traj.producer["gpu_peak_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
            return traj

    def sample(self, request: GenerationRequest) -> Trajectory:
        """`generate` for synchronous code in one process (no event loop): the single-GPU baseline."""
        self.load()
        return self._generate_locked(request, request.seed if request.seed is not None else draw_seed())

    async def generate(self, request: GenerationRequest) -> Trajectory:
        if not isinstance(request, GenerationRequest):
            raise TypeError(f"expected a GenerationRequest, got {type(request).__name__}")
        await self.start()
        seed = request.seed if request.seed is not None else draw_seed()
        try:
            traj = await asyncio.to_thread(self._generate_locked, request, seed)
        except Exception:
            self._errors += 1
            raise
        self._served += 1
        return traj

    async def generate_plain(self, request: GenerationRequest) -> torch.Tensor:
        """Stock diffusers sampling (`QwenImagePipeline.__call__`: its scheduler's ODE step, no trajectory) of the
        same group: uint8 [n, H, W, 3]. The baseline for measuring what trajectory recording costs."""
        await self.start()
        seed = request.seed if request.seed is not None else draw_seed()

        def run() -> torch.Tensor:
            with self._lock, torch.no_grad():
                out = self.pipe(prompt=request.prompt, negative_prompt=request.negative_prompt,
                                true_cfg_scale=request.guidance_scale, height=request.height, width=request.width,
                                num_inference_steps=request.num_inference_steps, num_images_per_prompt=request.n,
                                generator=sample_generators(seed, request.sample_offset, request.n),
                                output_type="pt")
                return (out.images.clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu()

        return await asyncio.to_thread(run)

    def _load_lora(self, adapter: LoraAdapter | None) -> int:
        with self._lock:
            transformer = self.pipe.transformer
            current = (getattr(transformer, "peft_config", None) or {}).get(ADAPTER_NAME)
            if adapter is None:
                if current is not None:
                    transformer.disable_adapters()
                self._lora_version = 0
                return 0
            if current is not None and (current.r, current.lora_alpha, sorted(current.target_modules)) != (
                    adapter.rank, adapter.alpha, sorted(adapter.target_modules)):
                transformer.delete_adapters(ADAPTER_NAME)  # a different rank/targets: start a fresh adapter
            attach_lora(transformer, adapter, ADAPTER_NAME)
            transformer.enable_adapters()
            transformer.set_adapter(ADAPTER_NAME)
            self._lora_version = adapter.version
            return adapter.version

    async def load_lora(self, adapter: LoraAdapter | None) -> int:
        await self.start()
        return await asyncio.to_thread(self._load_lora, adapter)

    async def update_weights(self, named_tensors: dict[str, torch.Tensor]) -> int:
        await self.start()

        def load() -> int:
            with self._lock:
                state = {transformer_key(k): v for k, v in named_tensors.items()}
                result = self.pipe.transformer.load_state_dict(state, strict=False)
                if result.unexpected_keys:
                    raise ValueError(f"unknown transformer weights: {result.unexpected_keys[:3]}")
                return len(state)

        return await asyncio.to_thread(load)

    async def health(self) -> dict:
        return {"kind": self.kind, "model": self.model_path, "started": self.pipe is not None,
                "lora_version": self._lora_version, "served": self._served, "errors": self._errors}

    async def close(self) -> None:
        self.pipe = None
