"""vllm-omni's Wan pipeline (`Wan22Pipeline`: Wan2.1 and Wan2.2 text to video) with the FlowGRPO sampler and
trajectory recording.

Loaded by vllm-omni through `custom_pipeline_args={"pipeline_class": ...}`, as the image families' are (what they do
alike: recording.py): per request it reads the request's `FlowGRPOArgs`, draws the initial video latents and every
SDE step's noise from per-sample generators, takes each step of vllm-omni's denoising loop (its CFG step hook) with
the shared recorder, and returns the trajectory through vllm-omni's trajectory fields (exchange.py), with UMT5's
states of the prompt (and the negative prompt under CFG) as the trajectory's conditioning (app/models/wan/model.py).

What vllm-omni 0.30's pipeline does its own way, set here for recorded requests:
- its schedule is its UniPC solver's with `flow_shift` 5 unless told otherwise; a recorded request runs Wan's flow
  schedule (σ linear 1 → 1/T, shifted by the checkpoint's own `flow_shift`: `app.models.wan.model.schedule`), the
  one the diffusers engine and the trainer use, through a stand-in scheduler that holds it;
- one expert (a checkpoint with a second, `transformer_2`, Wan2.2-A14B's, is refused: the trainer trains one): every
  step runs it at one guidance scale, so the boundary between experts is set to 0 (vllm-omni would warn and assume
  0.875 per request).

Requests without FlowGRPO arguments run the stock pipeline (its UniPC, the checkpoint's `flow_shift`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from vllm_omni.diffusion.models.wan2_2.pipeline_wan2_2 import (
    Wan22Pipeline,
    resolve_wan_flow_shift,
    resolve_wan_sample_solver,
)

from app.models.wan import model as wan
from app.rollout.vllm_omni.exchange import side_output
from app.rollout.vllm_omni.lora import StagedLoraPipeline
from app.rollout.vllm_omni.recording import Recording, RecordingPipeline


@dataclass
class _WanRecording(Recording):
    # UMT5's states [B·n, S, D] the transformer saw (each prompt's repeated for its samples), and under CFG the
    # negative prompts'
    embeds: torch.Tensor | None = None
    negative_embeds: torch.Tensor | None = None


class FlowGRPOWanPipeline(RecordingPipeline, StagedLoraPipeline, Wan22Pipeline):
    recording_class = _WanRecording

    def __init__(self, *, od_config, prefix: str = ""):
        super().__init__(od_config=od_config, prefix=prefix)
        if self.transformer_2 is not None:
            raise ValueError(f"{od_config.model} has a second expert (transformer_2, Wan2.2-A14B's): the trainer "
                             "trains and scores one transformer; use a one-expert Wan (Wan2.1-T2V, Wan2.2-TI2V-5B)")
        self.settings = wan.pipeline_settings(od_config.model)  # the checkpoint's flow_shift, expand_timesteps
        if self.boundary_ratio is None:
            self.boundary_ratio = 0.0  # one expert: every step is the "high-noise" stage, one guidance scale
        if self.od_config.flow_shift is None:  # the stock path samples with the checkpoint's shift, not 5
            self._flow_shift = self.settings["flow_shift"]

    def forward(self, req):
        rec = self.recording_for(req)
        if rec is None:
            return super().forward(req)
        first = req.requests[0]
        solver, shift = resolve_wan_sample_solver(first, default=self._sample_solver), self.settings["flow_shift"]
        if first.sampling_params.extra_args.get("flow_shift") not in (None, shift):
            raise ValueError(f"flow_shift: a recorded request samples the checkpoint's schedule (flow_shift {shift}), "
                             "the one the trainer scores; leave flow_shift unset")
        stock = (self.scheduler, self._sample_solver, self._flow_shift)
        # the stand-in holds Wan's flow schedule; the forward keeps it when solver and shift match its own
        self.scheduler = wan.euler_scheduler(shift)
        self._sample_solver, self._flow_shift = solver, resolve_wan_flow_shift(first, self.od_config)
        try:
            outputs = self.record(req, rec)
        finally:
            self.scheduler, self._sample_solver, self._flow_shift = stock
        latents, log_probs, timesteps, sigmas = rec.result()  # [B, T+1, C, F', h, w], [B, T], [T], [T+1]
        n = rec.samples_per_prompt
        for r, out in enumerate(outputs):
            embeds = rec.embeds[r * n].float().cpu()  # a prompt's samples share its states
            mask = torch.ones(embeds.shape[0], dtype=torch.long)  # Wan attends every position, zeros included
            fields = {"prompt_embeds": embeds, "prompt_mask": mask,
                      "conditioning": wan.conditioning(self.settings["expand_timesteps"])}
            if rec.negative_embeds is not None:  # CFG
                fields.update(negative_prompt_embeds=rec.negative_embeds[r * n].float().cpu(),
                              negative_prompt_mask=mask.clone())
            out.trajectory_latents = latents[r * n:(r + 1) * n]
            out.trajectory_log_probs = log_probs[r * n:(r + 1) * n]
            out.trajectory_timesteps = side_output(timesteps, sigmas, fields)
        return outputs

    def encode_prompt(self, *args, **kwargs):
        embeds, negative = super().encode_prompt(*args, **kwargs)  # [B·n, S, D] each
        rec = self._recording
        if rec is not None:
            rec.embeds = embeds.detach()
            rec.negative_embeds = negative.detach() if negative is not None else None
        return embeds, negative

    def prepare_latents(self, batch_size, num_channels_latents, height, width, num_frames, dtype, device, generator,
                        latents=None):
        if latents is None:
            generator = self.sample_generators_for(batch_size, generator)
        return super().prepare_latents(batch_size, num_channels_latents, height, width, num_frames, dtype, device,
                                       generator, latents)
