"""Stable Diffusion 3 on plain diffusers: the parity oracle for vllm-omni's SD3 pipeline, and the engine for clusters
without vllm-omni. `rollout.engine: diffusers` with `model.family: sd3`.

The Qwen-Image engine's machinery (app/rollout/diffusers_engine.py: loading the family's pipeline, text-only
requests, the per-sample mode, the LoRA as a peft adapter of the transformer) with SD3's components:
`StableDiffusion3Pipeline`'s three text encoders, the operations of app/models/sd3/model.py, the shared sample loop
(`app.algo.sampling`) and per-sample noise (app/rollout/seeding.py).
"""

from __future__ import annotations

import torch

from app.algo.sampling import sample_trajectory
from app.models.sd3 import FAMILY
from app.models.sd3 import model as sd3
from app.rollout.diffusers_engine import DiffusersEngine
from app.rollout.seeding import sample_generators
from app.types import GenerationRequest, Trajectory


class SD3Engine(DiffusersEngine):
    kind = "diffusers"
    family = FAMILY.name

    @torch.no_grad()
    def _encode(self, text: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(states [S, D], pooled [P]) of one text, as vllm-omni's pipeline encodes it (the same text for all three
        encoders, T5 padded to sd3.T5_MAX_LENGTH)."""
        embeds, _, pooled, _ = self.pipe.encode_prompt(text, None, None, device=self.device, num_images_per_prompt=1,
                                                       do_classifier_free_guidance=False,
                                                       max_sequence_length=sd3.T5_MAX_LENGTH)
        return embeds[0], pooled[0]

    @torch.no_grad()
    def _generate_group(self, request: GenerationRequest, seed: int) -> Trajectory:
        pipe, n = self.pipe, request.n
        with self.phases("encode"):
            embeds, pooled = self._encode(request.prompt)
            neg_embeds = neg_pooled = None
            conditioning = {sd3.POOLED: pooled.float().cpu()}
            if request.do_cfg:
                neg_embeds, neg_pooled = self._encode(request.negative_prompt)
                conditioning[sd3.NEGATIVE_POOLED] = neg_pooled.float().cpu()
        generators = sample_generators(seed, request.sample_offset, n)
        x = sd3.initial_latents(generators, pipe.transformer.config.in_channels, request.height, request.width,
                                embeds.dtype, self.device)  # [n, C, h, w]
        timesteps, sigmas = sd3.schedule(pipe.scheduler, request.num_inference_steps)
        v = sd3.group_velocity(pipe.transformer, timesteps, embeds, pooled, neg_embeds, neg_pooled, batch=n,
                               guidance_scale=request.guidance_scale, device=self.device, dtype=embeds.dtype)
        with self.phases("denoise"), self.cheaper_ode_steps(request) as cheaper:
            latents, log_probs = sample_trajectory(cheaper(v), x, sigmas, request.step_noise_levels,
                                                   sde_type=request.sde_type, generators=generators)
        with self.phases("decode"):
            images = sd3.decode_images(pipe.vae, latents[:, -1].to(device=self.device, dtype=x.dtype))
        mask = torch.ones(embeds.shape[0], dtype=torch.long)  # SD3 attends every text position
        return Trajectory.sampled(
            request, seed=seed, lora_version=self._lora_version, images=images, latents=latents.cpu(),
            log_probs=log_probs.cpu(), timesteps=timesteps, sigmas=sigmas, family=self.family,
            prompt_embeds=embeds.float().cpu(), prompt_mask=mask,
            negative_prompt_embeds=neg_embeds.float().cpu() if request.do_cfg else None,
            negative_prompt_mask=mask.clone() if request.do_cfg else None, conditioning=conditioning)

    def plain_guidance(self, request: GenerationRequest) -> dict:
        return {"guidance_scale": request.guidance_scale, "max_sequence_length": sd3.T5_MAX_LENGTH}
