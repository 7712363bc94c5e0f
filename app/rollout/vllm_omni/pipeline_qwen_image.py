"""vllm-omni's Qwen-Image pipeline with the FlowGRPO sampler and trajectory recording.

Loaded by vllm-omni through `custom_pipeline_args={"pipeline_class": ...}`. Per request (what the FlowGRPO
pipelines do alike: recording.py) it reads the request's `FlowGRPOArgs` (exchange.py), draws the initial latents
and every SDE step's noise from per-sample generators (app/rollout/seeding.py), takes each step of vllm-omni's
denoising loop with `app.algo.sampling`'s recorder in place of the scheduler step, and returns the trajectory
through vllm-omni's trajectory fields (exchange.py), with the prompt embeddings the transformer saw (and the
negative ones under CFG) as the trajectory's conditioning.

Requests without FlowGRPO arguments run the stock pipeline. The step-wise execution path is switched off: it
would bypass the SDE step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from vllm_omni.diffusion.models.qwen_image.pipeline_qwen_image import QwenImagePipeline

from app.rollout.vllm_omni.exchange import side_output
from app.rollout.vllm_omni.lora import StagedLoraPipeline
from app.rollout.vllm_omni.recording import Recording, RecordingPipeline


@dataclass
class _QwenImageRecording(Recording):
    embeds: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # name → (embeds, mask)


class FlowGRPOQwenImagePipeline(RecordingPipeline, StagedLoraPipeline, QwenImagePipeline):
    supports_step_execution = False  # the step-wise path calls the stock scheduler step
    _progress_bar_config = {"disable": True}  # a server's per-request denoising bars are noise in every log
    recording_class = _QwenImageRecording

    def forward(self, req):
        rec = self.recording_for(req)
        if rec is None:
            return super().forward(req)
        outputs = self.record(req, rec)
        latents, log_probs, timesteps, sigmas = rec.result()  # [B, T+1, L, C], [B, T], [T], [T+1]
        n = rec.samples_per_prompt
        for r, out in enumerate(outputs):
            fields = {}
            for name, (embeds, mask) in rec.embeds.items():
                valid = mask[r * n].bool().cpu()  # drop the padding of batched prompts of unequal length
                fields[f"{name}_embeds"] = embeds[r * n].float().cpu()[valid]
                fields[f"{name}_mask"] = mask[r * n].cpu()[valid].long()
            out.trajectory_latents = latents[r * n:(r + 1) * n]
            out.trajectory_log_probs = log_probs[r * n:(r + 1) * n]
            out.trajectory_timesteps = side_output(timesteps, sigmas, fields)
        return outputs

    def encode_prompt(self, *args, prompt_name: str = "prompt", **kwargs):
        embeds, mask = super().encode_prompt(*args, prompt_name=prompt_name, **kwargs)
        if self._recording is not None:
            self._recording.embeds[prompt_name] = (embeds.detach(), mask.detach())
        return embeds, mask

    def prepare_latents(self, batch_size, num_channels_latents, height, width, dtype, device, generator, latents=None):
        generator = self.sample_generators_for(batch_size, generator) if latents is None else generator
        return super().prepare_latents(batch_size, num_channels_latents, height, width, dtype, device, generator,
                                       latents)
