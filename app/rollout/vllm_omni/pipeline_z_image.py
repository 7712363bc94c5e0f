"""vllm-omni's Z-Image pipeline with the FlowGRPO sampler and trajectory recording.

Loaded by vllm-omni through `custom_pipeline_args={"pipeline_class": ...}`, as the other families' are (what they
do alike: recording.py): per request it reads the request's `FlowGRPOArgs`, draws the initial latents and every SDE
step's noise from per-sample generators, takes each step of vllm-omni's denoising loop with the shared recorder in
place of the scheduler's step, and returns the trajectory through vllm-omni's trajectory fields (exchange.py), with
the captions the transformer saw (the prompt's and, under CFG, the negative prompt's Qwen3 states) as the
trajectory's conditioning.

Two things vllm-omni 0.30's pipeline does its own way, fixed here:
- it builds its transformer at Z-Image's published size whatever `transformer/config.json` says: the transformer
  is built from that config instead (any checkpoint of the architecture, the tiny one included);
- its denoising loop calls `self.scheduler.step` itself (no step hook as the CFG-parallel pipelines have): during a
  recorded request the scheduler is a stand-in whose `step` is the recorded SDE step.
The schedule comes with the request (`sigmas`: app/models/z_image/__init__.py), as diffusers' `ZImagePipeline`
builds it, since vllm-omni's default spacing differs from it.

Requests without FlowGRPO arguments run the stock pipeline.
"""

from __future__ import annotations

import functools
import inspect
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from vllm_omni.diffusion.models.z_image import pipeline_z_image
from vllm_omni.diffusion.models.z_image.pipeline_z_image import ZImagePipeline

from app.platform.vllm_omni.cpu_ops import define_missing_ops
from app.rollout.vllm_omni.exchange import side_output
from app.rollout.vllm_omni.lora import StagedLoraPipeline
from app.rollout.vllm_omni.recording import Recording, RecordingPipeline

define_missing_ops()  # before the pipeline is built: the transformer's MLP binds vLLM's silu_and_mul


@dataclass
class _ZImageRecording(Recording):
    # one caption [S, D] per prompt of the batch, and under CFG one negative caption each
    captions: list[torch.Tensor] = field(default_factory=list)
    negative_captions: list[torch.Tensor] = field(default_factory=list)


class _RecordingScheduler:
    """The pipeline's scheduler during a recorded request: `step` is the recorded SDE step, the rest is the real
    scheduler's."""

    def __init__(self, pipeline, scheduler):
        self._pipeline, self._scheduler = pipeline, scheduler

    def step(self, noise_pred, t, latents, return_dict=False, **_):
        prev = self._pipeline.recorded_step(self._scheduler, noise_pred, t, latents)
        return (prev,) if not return_dict else type("StepOutput", (), {"prev_sample": prev})()

    def __getattr__(self, name):
        return getattr(self._scheduler, name)

    def __setattr__(self, name, value):
        if name in ("_pipeline", "_scheduler"):
            object.__setattr__(self, name, value)
        else:
            setattr(self._scheduler, name, value)


def _transformer_kwargs(model_dir) -> dict:
    """The checkpoint's transformer config, as arguments of vllm-omni's `ZImageTransformer2DModel`."""
    config = json.loads((Path(model_dir) / "transformer" / "config.json").read_text())
    accepted = inspect.signature(pipeline_z_image.ZImageTransformer2DModel.__init__).parameters
    return {k: v for k, v in config.items() if k in accepted}


class FlowGRPOZImagePipeline(RecordingPipeline, StagedLoraPipeline, ZImagePipeline):
    recording_class = _ZImageRecording

    def __init__(self, *, od_config, prefix: str = ""):
        stock = pipeline_z_image.ZImageTransformer2DModel
        pipeline_z_image.ZImageTransformer2DModel = functools.partial(stock, **_transformer_kwargs(od_config.model))
        try:
            super().__init__(od_config=od_config, prefix=prefix)
        finally:
            pipeline_z_image.ZImageTransformer2DModel = stock

    def forward(self, req):
        rec = self.recording_for(req)
        if rec is None:
            return super().forward(req)
        scheduler = self.scheduler
        self.scheduler = _RecordingScheduler(self, scheduler)
        try:
            output = self.record(req, rec)
        finally:
            self.scheduler = scheduler
        latents, log_probs, timesteps, sigmas = rec.result()  # [B, T+1, C, h, w], [B, T], [T], [T+1]
        n = rec.samples_per_prompt
        outputs = output if isinstance(output, list) else [output]
        for r, out in enumerate(outputs):
            caption = rec.captions[r].float().cpu()
            fields = {"prompt_embeds": caption, "prompt_mask": torch.ones(caption.shape[0], dtype=torch.long)}
            if rec.negative_captions:  # CFG
                negative = rec.negative_captions[r].float().cpu()
                fields.update(negative_prompt_embeds=negative,
                              negative_prompt_mask=torch.ones(negative.shape[0], dtype=torch.long))
            out.trajectory_latents = latents[r * n:(r + 1) * n]
            out.trajectory_log_probs = log_probs[r * n:(r + 1) * n]
            out.trajectory_timesteps = side_output(timesteps, sigmas, fields)
        return output

    def encode_prompt(self, *args, **kwargs):
        captions, negative = super().encode_prompt(*args, **kwargs)  # one [S_i, D] per prompt (not yet repeated)
        rec = self._recording
        if rec is not None:
            rec.captions = [c.detach() for c in captions]
            rec.negative_captions = [c.detach() for c in negative or []]
        return captions, negative

    def prepare_latents(self, batch_size, num_channels_latents, height, width, dtype, device, generator,
                        latents=None, image=None, timestep=None):
        if latents is None and image is None:
            generator = self.sample_generators_for(batch_size, generator)
        return super().prepare_latents(batch_size, num_channels_latents, height, width, dtype, device, generator,
                                       latents, image, timestep)
