"""vllm-omni's Stable Diffusion 3 pipeline with the FlowGRPO sampler and trajectory recording.

Loaded by vllm-omni through `custom_pipeline_args={"pipeline_class": ...}`, as the Qwen-Image one is
(pipeline_qwen_image.py; what both do alike: recording.py): per request it reads the request's `FlowGRPOArgs`,
draws the initial latents and every SDE step's noise from per-sample generators, takes each step of vllm-omni's
denoising loop with the shared recorder in place of the scheduler step, and returns the trajectory through
vllm-omni's trajectory fields (exchange.py), with the text states and pooled embeddings the transformer saw (and
the negative prompt's under CFG) as the trajectory's conditioning (app/models/sd3/model.py names).

vllm-omni's SD3 encodes one text per prompt while it draws `num_outputs_per_prompt` latents per prompt; here each
prompt's encoding is repeated for its samples, so a group of n is one request and one batch of n.

Requests without FlowGRPO arguments run the stock pipeline.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from vllm_omni.diffusion.models.sd3.pipeline_sd3 import StableDiffusion3Pipeline

from app.models.sd3.model import NEGATIVE_POOLED, POOLED
from app.rollout.vllm_omni.exchange import side_output
from app.rollout.vllm_omni.lora import StagedLoraPipeline
from app.rollout.vllm_omni.recording import Recording, RecordingPipeline


@dataclass
class _SD3Recording(Recording):
    # per prompt of the batch: (states [B, S, D], pooled [B, P]); the first encoding is the prompts', the second
    # (under CFG) the negative prompts'
    encodings: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)


class FlowGRPOSD3Pipeline(RecordingPipeline, StagedLoraPipeline, StableDiffusion3Pipeline):
    recording_class = _SD3Recording

    def forward(self, req):
        rec = self.recording_for(req)
        if rec is None:
            return super().forward(req)
        outputs = self.record(req, rec)
        latents, log_probs, timesteps, sigmas = rec.result()  # [B, T+1, C, h, w], [B, T], [T], [T+1]
        n, (embeds, pooled) = rec.samples_per_prompt, rec.encodings[0]
        mask = torch.ones(embeds.shape[1], dtype=torch.long)  # SD3 attends every text position
        for r, out in enumerate(outputs):
            fields = {"prompt_embeds": embeds[r].float().cpu(), "prompt_mask": mask,
                      "conditioning": {POOLED: pooled[r].float().cpu()}}
            if len(rec.encodings) > 1:  # CFG
                neg_embeds, neg_pooled = rec.encodings[1]
                fields.update(negative_prompt_embeds=neg_embeds[r].float().cpu(), negative_prompt_mask=mask.clone())
                fields["conditioning"][NEGATIVE_POOLED] = neg_pooled[r].float().cpu()
            out.trajectory_latents = latents[r * n:(r + 1) * n]
            out.trajectory_log_probs = log_probs[r * n:(r + 1) * n]
            out.trajectory_timesteps = side_output(timesteps, sigmas, fields)
        return outputs

    def encode_prompt(self, *args, **kwargs):
        embeds, pooled = super().encode_prompt(*args, **kwargs)  # [B, S, D], [B, P]: one per prompt
        rec = self._recording
        if rec is None:
            return embeds, pooled
        rec.encodings.append((embeds.detach(), pooled.detach()))
        n = rec.samples_per_prompt  # each prompt's samples are consecutive in the batch (request-major)
        return embeds.repeat_interleave(n, dim=0), pooled.repeat_interleave(n, dim=0)

    def prepare_latents(self, batch_size, num_channels_latents, height, width, generator, latents=None):
        generator = self.sample_generators_for(batch_size, generator) if latents is None else generator
        return super().prepare_latents(batch_size, num_channels_latents, height, width, generator, latents)
