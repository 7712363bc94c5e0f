"""vllm-omni's Qwen-Image pipeline with the FlowGRPO sampler and trajectory recording.

Loaded by vllm-omni through `custom_pipeline_args={"pipeline_class": ...}`. Per request it reads the request's
`FlowGRPOArgs` (exchange.py), draws the initial latents and every SDE step's noise from per-sample generators
(app/rollout/seeding.py), takes each step of vllm-omni's denoising loop with `app.algo.sampling`'s recorder in
place of the scheduler step, and returns the trajectory through vllm-omni's trajectory fields (exchange.py), with
the prompt embeddings the transformer saw (and the negative ones under CFG) as the trajectory's conditioning.

Requests without FlowGRPO arguments run the stock pipeline. The step-wise execution path is switched off: it
would bypass the SDE step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from vllm_omni.diffusion.models.qwen_image.pipeline_qwen_image import QwenImagePipeline

from app.algo.sampling import TrajectoryRecorder
from app.algo.sde_window import noise_levels
from app.rollout.seeding import sample_generators
from app.rollout.vllm_omni.exchange import FlowGRPOArgs, side_output
from app.rollout.vllm_omni.lora import StagedLoraPipeline


@dataclass
class _Recording:
    """What one forward (possibly several batched requests) records, in batch order (request-major)."""

    generators: list[torch.Generator]
    args: FlowGRPOArgs  # the batch's shared noise level, SDE type and window
    recorder: TrajectoryRecorder | None = None  # made at the first step, when the schedule is known
    timesteps: list[torch.Tensor] = field(default_factory=list)  # T × []
    embeds: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # name → (embeds, mask)


class FlowGRPOQwenImagePipeline(StagedLoraPipeline, QwenImagePipeline):
    supports_step_execution = False  # the step-wise path calls the stock scheduler step
    _progress_bar_config = {"disable": True}  # a server's per-request denoising bars are noise in every log
    _recording: _Recording | None = None

    def forward(self, req):
        params = req.sampling_params_list
        args = [FlowGRPOArgs.of(p) for p in params]
        if all(a is None for a in args):
            return super().forward(req)
        if any(a is None for a in args):
            raise ValueError("FlowGRPO and plain requests cannot share a batch")
        if len({a.batch_key() for a in args}) != 1:
            raise ValueError("requests batched together must share noise_level, sde_type and sde_window")
        n = params[0].num_outputs_per_prompt if params[0].num_outputs_per_prompt > 0 else 1
        generators = [g for a in args for g in sample_generators(a.seed, a.sample_offset, n)]
        self._recording = rec = _Recording(generators, args[0])
        try:
            outputs = super().forward(req)
        finally:
            self._recording = None
        latents, log_probs = rec.recorder.result()
        latents, log_probs = latents.cpu(), log_probs.cpu()  # [B, T+1, L, C], [B, T]
        timesteps = torch.stack([t.reshape(()) for t in rec.timesteps]).float().cpu()  # [T]
        sigmas = rec.recorder.sigmas.float().cpu()
        for r, out in enumerate(outputs):
            group = slice(r * n, (r + 1) * n)
            fields = {}
            for name, (embeds, mask) in rec.embeds.items():
                valid = mask[r * n].bool().cpu()  # drop the padding of batched prompts of unequal length
                fields[f"{name}_embeds"] = embeds[r * n].float().cpu()[valid]
                fields[f"{name}_mask"] = mask[r * n].cpu()[valid].long()
            out.trajectory_latents = latents[group]
            out.trajectory_log_probs = log_probs[group]
            out.trajectory_timesteps = side_output(timesteps, sigmas, fields)
        return outputs

    def encode_prompt(self, *args, prompt_name: str = "prompt", **kwargs):
        embeds, mask = super().encode_prompt(*args, prompt_name=prompt_name, **kwargs)
        if self._recording is not None:
            self._recording.embeds[prompt_name] = (embeds.detach(), mask.detach())
        return embeds, mask

    def prepare_latents(self, batch_size, num_channels_latents, height, width, dtype, device, generator, latents=None):
        if self._recording is not None and latents is None:
            generator = self._recording.generators  # one per sample: batching never changes a sample's noise
            if len(generator) != batch_size:
                raise ValueError(f"{len(generator)} sample generators for a batch of {batch_size}")
        return super().prepare_latents(batch_size, num_channels_latents, height, width, dtype, device, generator,
                                       latents)

    def scheduler_step_maybe_with_cfg(self, noise_pred, t, latents, do_true_cfg, per_request_scheduler=None,
                                      generator=None):
        rec = self._recording
        if rec is None:
            return super().scheduler_step_maybe_with_cfg(noise_pred, t, latents, do_true_cfg, per_request_scheduler,
                                                         generator)
        sched = per_request_scheduler or self.scheduler
        if sched.step_index is None:
            sched._init_step_index(t)
        if rec.recorder is None:
            steps = len(sched.sigmas) - 1
            rec.recorder = TrajectoryRecorder(sched.sigmas, noise_levels(rec.args.noise_level, steps,
                                                                         rec.args.sde_window),
                                              sde_type=rec.args.sde_type, generators=rec.generators)
        if sched.step_index != rec.recorder.steps_taken:
            raise RuntimeError(f"vllm-omni's scheduler is at step {sched.step_index}; the recording at "
                               f"{rec.recorder.steps_taken}")
        prev = rec.recorder.step(noise_pred, latents)
        sched._step_index += 1
        rec.timesteps.append(t.detach())
        return prev
