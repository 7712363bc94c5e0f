"""The BAGEL rollout engine in pure torch: our `BagelMoT` (app/models/bagel/model.py), the model the trainer
differentiates, so its fp32 rollouts re-score to exactly the same log-probs; the engine for clusters without
vllm-omni and the parity oracle for vllm-omni's BAGEL pipeline.

One request per prompt group: the group's CFG contexts are built once (text, and for an edit the input image's
autoencoder and ViT blocks) and shared by its n samples, which are denoised as one batch, each from its own
generator (app/rollout/seeding.py). A request's `num_inference_steps` T is the number of denoising steps: BAGEL's
schedule then has T + 1 points (vllm-omni's `num_inference_steps` counts the points).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from app.models.bagel import FAMILY, flux_ae
from app.models.bagel import model as bagel
from app.models.bagel.context import build_contexts, edit_conditioning, latent_grid, text_conditioning
from app.rollout.local_engine import LocalEngine
from app.rollout.seeding import sample_generators
from app.types import GenerationRequest, Trajectory


class BagelEngine(LocalEngine):
    kind = "bagel"
    family = FAMILY.name

    def load_model(self) -> None:
        from transformers import Qwen2Tokenizer  # BAGEL's (AutoTokenizer would read config.json's model type)

        path = Path(self.model_path)
        self.model = bagel.BagelMoT.from_checkpoint(path, dtype=self.dtype, device=self.device)
        self.tokenizer = Qwen2Tokenizer.from_pretrained(path)
        self.ae_params = flux_ae.autoencoder_params(json.loads((path / "config.json").read_text()))
        self.autoencoder = flux_ae.load_flux_autoencoder(path / "ae.safetensors", self.ae_params,
                                                         dtype=self.dtype).to(self.device)
        self.image_processor = None
        if self.model.vit_model is not None:
            from transformers import SiglipImageProcessor

            self.image_processor = SiglipImageProcessor.from_pretrained(path)

    def trained_module(self) -> torch.nn.Module:
        return self.model

    def conditioning(self, request: GenerationRequest) -> dict[str, torch.Tensor]:
        """What the group's contexts are built from (stored in its trajectory)."""
        out = text_conditioning(self.tokenizer, request.prompt, request.negative_prompt if request.do_cfg else None)
        if request.is_edit:
            if self.image_processor is None:
                raise ValueError("image: this BAGEL checkpoint has no ViT (vit_config), so it cannot edit images")
            config = self.model.config
            out.update(edit_conditioning(request.image, autoencoder=self.autoencoder,
                                         autoencoder_params=self.ae_params, image_processor=self.image_processor,
                                         stride=config.vae_downsample * config.latent_patch_size,
                                         max_latent_size=config.max_latent_size,
                                         latent_patch=config.latent_patch_size))
        return out

    def _generate(self, request: GenerationRequest, seed: int) -> Trajectory:
        model, config = self.model, self.model.config
        grid = latent_grid(model, request.height, request.width)
        if max(grid) > config.max_latent_size:
            largest = config.max_latent_size * config.vae_downsample * config.latent_patch_size
            raise ValueError(f"height={request.height}, width={request.width}: this BAGEL checkpoint generates at "
                             f"most {largest}x{largest}")
        guidance = bagel.Guidance(text_scale=request.guidance_scale, img_scale=request.image_guidance_scale,
                                  interval=tuple(request.cfg_interval), renorm=request.cfg_renorm,
                                  renorm_min=request.cfg_renorm_min)
        with self.phases("encode"):  # the prompt's (and an edit's image's) contexts, block by block
            conditioning = self.conditioning(request)
            contexts = build_contexts(model, conditioning, guidance)
        sigmas = bagel.schedule(request.num_inference_steps + 1, request.timestep_shift)
        marks = tuple(int(i) for i in conditioning["image_tokens"])
        with self.phases("denoise"):
            latents, log_probs = bagel.sample_group(
                model, contexts, guidance, generators=sample_generators(seed, request.sample_offset, request.n),
                grid=grid, image_tokens=marks, sigmas=sigmas, noise_levels=request.step_noise_levels,
                sde_type=request.sde_type)
        with self.phases("decode"):
            final = torch.stack([bagel.unpatchify(x, grid, config.latent_patch_size) for x in latents[:, -1]])
            images = flux_ae.decode(self.autoencoder, final, self.ae_params)
        return Trajectory.sampled(
            request, seed=seed, lora_version=self._lora_version, images=images, latents=latents.float().cpu(),
            log_probs=log_probs.float().cpu(), timesteps=sigmas[:-1].clone(), sigmas=sigmas, family=FAMILY.name,
            conditioning={k: v.cpu() for k, v in conditioning.items()})
