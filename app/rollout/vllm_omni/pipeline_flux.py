"""vllm-omni's FLUX.1 pipeline with the FlowGRPO sampler and trajectory recording.

Loaded by vllm-omni through `custom_pipeline_args={"pipeline_class": ...}`, as the Qwen-Image and SD3 ones are
(what they do alike: recording.py): per request it reads the request's `FlowGRPOArgs`, draws the initial latents
and every SDE step's noise from per-sample generators, takes each step of vllm-omni's denoising loop with the shared
recorder in place of the scheduler step, and returns the trajectory through vllm-omni's trajectory fields
(exchange.py), with the T5 states and CLIP's pooled embedding the transformer saw (and the negative prompt's under
true CFG) as the trajectory's conditioning (app/models/flux/model.py names). The guidance-distilled model's guidance
input is the request's `guidance_scale` sampling parameter, as vllm-omni's own pipeline takes it.

vllm-omni's FLUX encodes each prompt once and repeats it for the prompt's `num_outputs_per_prompt` samples; the
recording keeps one encoding per prompt.

Requests without FlowGRPO arguments run the stock pipeline.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from vllm_omni.diffusion.models.flux.pipeline_flux import FluxPipeline

from app.models.flux.model import NEGATIVE_POOLED, POOLED
from app.platform.vllm_omni.cpu_ops import define_missing_ops
from app.rollout.vllm_omni.exchange import side_output
from app.rollout.vllm_omni.lora import StagedLoraPipeline
from app.rollout.vllm_omni.recording import Recording, RecordingPipeline

define_missing_ops()  # before the pipeline is built: vllm-omni's T5 binds vLLM's gelu_new


@dataclass
class _FluxRecording(Recording):
    # per prompt of the batch: (states [B, S, D], pooled [B, P]); the first encoding is the prompts', the second
    # (under true CFG) the negative prompts'
    encodings: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)


class FlowGRPOFluxPipeline(RecordingPipeline, StagedLoraPipeline, FluxPipeline):
    recording_class = _FluxRecording

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # vLLM's LoRA manager packs an adapter's q, k, v onto a fused projection only through the model's
        # `stacked_params_mapping`, which vllm-omni 0.30's FLUX transformer keeps local to its weight loader (its
        # SD3 and Qwen-Image ones set it): without it the adapter's q/k/v layers stay unbound. Made here from the
        # transformer's own `packed_modules_mapping` (to_qkv: to_q, to_k, to_v; add_kv_proj: add_q/k/v_proj).
        transformer = self.transformer
        if not getattr(transformer, "stacked_params_mapping", None):
            transformer.stacked_params_mapping = [
                (f".{fused}", f".{part}", shard) for fused, parts in transformer.packed_modules_mapping.items()
                for part, shard in zip(parts, ("q", "k", "v"), strict=True)]

    def forward(self, req):
        rec = self.recording_for(req)
        if rec is None:
            return super().forward(req)
        outputs = self.record(req, rec)
        latents, log_probs, timesteps, sigmas = rec.result()  # [B, T+1, L, 4C], [B, T], [T], [T+1]
        n, (embeds, pooled) = rec.samples_per_prompt, rec.encodings[0]
        mask = torch.ones(embeds.shape[1], dtype=torch.long)  # FLUX attends every text position
        for r, out in enumerate(outputs):
            fields = {"prompt_embeds": embeds[r].float().cpu(), "prompt_mask": mask,
                      "conditioning": {POOLED: pooled[r].float().cpu()}}
            if len(rec.encodings) > 1:  # true CFG
                neg_embeds, neg_pooled = rec.encodings[1]
                fields.update(negative_prompt_embeds=neg_embeds[r].float().cpu(), negative_prompt_mask=mask.clone())
                fields["conditioning"][NEGATIVE_POOLED] = neg_pooled[r].float().cpu()
            out.trajectory_latents = latents[r * n:(r + 1) * n]
            out.trajectory_log_probs = log_probs[r * n:(r + 1) * n]
            out.trajectory_timesteps = side_output(timesteps, sigmas, fields)
        return outputs

    def encode_prompt(self, *args, **kwargs):
        embeds, pooled, text_ids = super().encode_prompt(*args, **kwargs)  # [B·n, S, D], [B·n, P]: repeated
        rec = self._recording
        if rec is not None:
            n = rec.samples_per_prompt  # each prompt's samples are consecutive in the batch (request-major)
            rec.encodings.append((embeds[::n].detach(), pooled[::n].detach()))
        return embeds, pooled, text_ids

    def prepare_latents(self, batch_size, num_channels_latents, height, width, dtype, device, generator,
                        latents=None):
        generator = self.sample_generators_for(batch_size, generator) if latents is None else generator
        return super().prepare_latents(batch_size, num_channels_latents, height, width, dtype, device, generator,
                                       latents)
