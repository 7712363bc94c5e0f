"""Z-Image on plain diffusers: the parity oracle for vllm-omni's Z-Image pipeline, and the engine for clusters
without vllm-omni. `rollout.engine: diffusers` with `model.family: z_image`.

The Qwen-Image engine's machinery (app/rollout/diffusers_engine.py: loading the family's pipeline, text-only
requests, the per-sample mode, the LoRA as a peft adapter of the transformer) with Z-Image's components:
`ZImagePipeline`'s Qwen3 caption encoding, the operations of app/models/z_image/model.py (fp32 latents, the
transformer's lists, CFG as Z-Image computes it), the shared sample loop (`app.algo.sampling`) and per-sample noise
(app/rollout/seeding.py).
"""

from __future__ import annotations

import torch

from app.algo.sampling import sample_trajectory
from app.models.z_image import FAMILY
from app.models.z_image import model as z_image
from app.rollout.diffusers_engine import DiffusersEngine
from app.rollout.seeding import sample_generators
from app.types import GenerationRequest, Trajectory


class ZImageEngine(DiffusersEngine):
    kind = "diffusers"
    family = FAMILY.name

    @torch.no_grad()
    def _encode(self, text: str) -> torch.Tensor:
        """The caption [S, D] of one text as both pipelines encode it (chat-wrapped, its S tokens, no padding)."""
        return self.pipe.encode_prompt(text, device=self.device, do_classifier_free_guidance=False,
                                       max_sequence_length=z_image.MAX_SEQUENCE_LENGTH)[0][0]

    @torch.no_grad()
    def _generate_group(self, request: GenerationRequest, seed: int) -> Trajectory:
        pipe, n = self.pipe, request.n
        with self.phases("encode"):
            embeds = self._encode(request.prompt)
            neg_embeds = self._encode(request.negative_prompt or "") if request.do_cfg else None
        generators = sample_generators(seed, request.sample_offset, n)
        x = z_image.initial_latents(generators, pipe.transformer.config.in_channels, request.height, request.width,
                                    self.device)  # [n, C, h, w] fp32
        tokens = z_image.image_tokens(request.height, request.width)
        timesteps, sigmas = z_image.schedule(pipe.scheduler, request.num_inference_steps, tokens)
        v = z_image.group_velocity(pipe.transformer, timesteps, embeds, neg_embeds, batch=n,
                                   guidance_scale=request.guidance_scale, device=self.device, dtype=embeds.dtype)
        with self.phases("denoise"), self.cheaper_ode_steps(request) as cheaper:
            latents, log_probs = sample_trajectory(cheaper(v), x, sigmas, request.step_noise_levels,
                                                   sde_type=request.sde_type, generators=generators)
        with self.phases("decode"):
            images = z_image.decode_images(pipe.vae, latents[:, -1].to(self.device))

        def mask(states):
            return torch.ones(states.shape[0], dtype=torch.long)

        return Trajectory.sampled(
            request, seed=seed, lora_version=self._lora_version, images=images, latents=latents.cpu(),
            log_probs=log_probs.cpu(), timesteps=timesteps, sigmas=sigmas, family=self.family,
            prompt_embeds=embeds.float().cpu(), prompt_mask=mask(embeds),
            negative_prompt_embeds=neg_embeds.float().cpu() if request.do_cfg else None,
            negative_prompt_mask=mask(neg_embeds) if request.do_cfg else None)

    def plain_guidance(self, request: GenerationRequest) -> dict:
        # Z-Image's own scale is ours minus one (app/models/z_image/model.py)
        return {"guidance_scale": max(request.guidance_scale - 1, 0.0),
                "max_sequence_length": z_image.MAX_SEQUENCE_LENGTH}
