"""Wan on plain diffusers: the parity oracle for vllm-omni's Wan pipeline, and the engine for clusters without
vllm-omni. `rollout.engine: diffusers` with `model.family: wan`.

The Qwen-Image engine's machinery (app/rollout/diffusers_engine.py: loading the family's pipeline, text-only
requests, the per-sample mode, the LoRA as a peft adapter of the transformer) with Wan's components: `WanPipeline`'s
UMT5 prompt encoding, the operations of app/models/wan/model.py (fp32 video latents, a forward per CFG branch), the
shared sample loop (`app.algo.sampling`) and per-sample noise (app/rollout/seeding.py). A group of N videos is one
batch of N through the transformer; the VAE decodes them one at a time.
"""

from __future__ import annotations

import torch

from app.algo.sampling import sample_trajectory
from app.models.wan import FAMILY
from app.models.wan import model as wan
from app.rollout.diffusers_engine import DiffusersEngine
from app.rollout.seeding import sample_generators
from app.types import GenerationRequest, Trajectory


class WanEngine(DiffusersEngine):
    kind = "diffusers"
    family = FAMILY.name

    def load_model(self) -> None:
        super().load_model()
        self.settings = wan.pipeline_settings(self.model_path)

    @torch.no_grad()
    def _encode(self, text: str) -> torch.Tensor:
        """UMT5's states [S, D] of one text as the pipeline encodes them (padded with zeros to S)."""
        return self.pipe.encode_prompt(text, do_classifier_free_guidance=False, device=self.device,
                                       max_sequence_length=wan.MAX_SEQUENCE_LENGTH)[0][0]

    @torch.no_grad()
    def _generate_group(self, request: GenerationRequest, seed: int) -> Trajectory:
        pipe, n = self.pipe, request.n
        with self.phases("encode"):
            embeds = self._encode(request.prompt).to(self.dtype)
            neg_embeds = self._encode(request.negative_prompt or "").to(self.dtype) if request.do_cfg else None
        generators = sample_generators(seed, request.sample_offset, n)
        shape = wan.latent_shape(pipe.transformer.config.in_channels, request.num_frames, request.height,
                                 request.width, pipe.vae_scale_factor_spatial)
        x = wan.initial_latents(generators, shape, self.device)  # [n, C, F', h, w] fp32
        timesteps, sigmas = wan.schedule(self.settings["flow_shift"], request.num_inference_steps)
        v = wan.group_velocity(pipe.transformer, timesteps, embeds, neg_embeds, batch=n,
                               guidance_scale=request.guidance_scale,
                               expand_timesteps=self.settings["expand_timesteps"], device=self.device,
                               dtype=self.dtype)
        with self.phases("denoise"), self.cheaper_ode_steps(request) as cheaper:
            latents, log_probs = sample_trajectory(cheaper(v), x, sigmas, request.step_noise_levels,
                                                   sde_type=request.sde_type, generators=generators)
        with self.phases("decode"):
            videos = wan.decode_videos(pipe.vae, latents[:, -1].to(self.device))

        def mask(states):
            return torch.ones(states.shape[0], dtype=torch.long)

        return Trajectory.sampled(
            request, seed=seed, lora_version=self._lora_version, images=videos, latents=latents.cpu(),
            log_probs=log_probs.cpu(), timesteps=timesteps, sigmas=sigmas, family=self.family,
            prompt_embeds=embeds.float().cpu(), prompt_mask=mask(embeds),
            negative_prompt_embeds=neg_embeds.float().cpu() if request.do_cfg else None,
            negative_prompt_mask=mask(neg_embeds) if request.do_cfg else None,
            conditioning=wan.conditioning(self.settings["expand_timesteps"]))

    def _plain(self, request: GenerationRequest, seed: int) -> torch.Tensor:
        """Stock `WanPipeline` sampling (its denoising loop, diffusers' Euler step on Wan's schedule in place of the
        checkpoint's UniPC, no trajectory) of the group: uint8 [n, F, H, W, 3]."""
        solver, self.pipe.scheduler = self.pipe.scheduler, wan.euler_scheduler(self.settings["flow_shift"])
        try:
            out = self.pipe(prompt=request.prompt, negative_prompt=request.negative_prompt, height=request.height,
                            width=request.width, num_frames=request.num_frames,
                            num_inference_steps=request.num_inference_steps, num_videos_per_prompt=request.n,
                            guidance_scale=request.guidance_scale, max_sequence_length=wan.MAX_SEQUENCE_LENGTH,
                            generator=sample_generators(seed, request.sample_offset, request.n), output_type="np")
        finally:
            self.pipe.scheduler = solver
        return torch.from_numpy((out.frames * 255).round().astype("uint8"))
