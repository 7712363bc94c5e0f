"""What every FlowGRPO pipeline on vllm-omni's CFG-parallel pipelines does the same way (pipeline_qwen_image.py,
pipeline_sd3.py): read a batch's `FlowGRPOArgs` (exchange.py), run the stock `forward` while recording, and take
each step of vllm-omni's denoising loop with `app.algo.sampling`'s recorder in place of the scheduler step."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from app.algo.sampling import TrajectoryRecorder
from app.algo.sde_window import noise_levels
from app.models.precision import exact_fp32
from app.platform.vllm_omni.warmup import on_the_cpu_platform, shrink_warmup
from app.rollout.seeding import sample_generators
from app.rollout.vllm_omni.exchange import FlowGRPOArgs

shrink_warmup(on_the_cpu_platform)  # imported in the engine process before its warm-up request


@dataclass
class Recording:
    """What one forward (possibly several batched requests) records, in batch order (request-major). A pipeline
    subclasses it for its conditioning."""

    generators: list[torch.Generator]  # one per sample: batching never changes a sample's noise
    args: FlowGRPOArgs  # the batch's shared noise level, SDE type and window
    samples_per_prompt: int
    recorder: TrajectoryRecorder | None = None  # made at the first step, when the schedule is known
    timesteps: list[torch.Tensor] = field(default_factory=list)  # T × []

    def result(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(latents [B, T+1, ...], log_probs [B, T], timesteps [T], sigmas [T+1]) on the CPU, fp32."""
        latents, log_probs = self.recorder.result()
        timesteps = torch.stack([t.reshape(()) for t in self.timesteps]).float().cpu()
        return latents.cpu(), log_probs.cpu(), timesteps, self.recorder.sigmas.float().cpu()


class RecordingPipeline:
    """Mixin placed before a vllm-omni pipeline class: `record(req)` runs its forward with a recording, and the
    scheduler step becomes the recorded SDE step."""

    recording_class = Recording
    _recording: Recording | None = None

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        exact_fp32(self.od_config.dtype)  # in vllm-omni's worker process, where the transformer runs

    def recording_for(self, req) -> Recording | None:
        """The recording of a batch of FlowGRPO requests; None for plain requests (the stock pipeline)."""
        params = req.sampling_params_list
        args = [FlowGRPOArgs.of(p) for p in params]
        if all(a is None for a in args):
            return None
        if any(a is None for a in args):
            raise ValueError("FlowGRPO and plain requests cannot share a batch")
        if len({a.batch_key() for a in args}) != 1:
            raise ValueError("requests batched together must share noise_level, sde_type and sde_window")
        n = params[0].num_outputs_per_prompt if params[0].num_outputs_per_prompt > 0 else 1
        generators = [g for a in args for g in sample_generators(a.seed, a.sample_offset, n)]
        return self.recording_class(generators, args[0], n)

    def record(self, req, rec: Recording):
        """The stock forward's outputs, with `rec` filled."""
        self._recording = rec
        try:
            return super().forward(req)
        finally:
            self._recording = None

    def sample_generators_for(self, batch_size: int, generator):
        """The generators `prepare_latents` draws the initial noise from: the recording's, one per sample."""
        if self._recording is None:
            return generator
        if len(self._recording.generators) != batch_size:
            raise ValueError(f"{len(self._recording.generators)} sample generators for a batch of {batch_size}")
        return self._recording.generators

    def scheduler_step_maybe_with_cfg(self, noise_pred, t, latents, do_true_cfg, per_request_scheduler=None,
                                      generator=None):
        rec = self._recording
        if rec is None:
            return super().scheduler_step_maybe_with_cfg(noise_pred, t, latents, do_true_cfg, per_request_scheduler,
                                                         generator)
        return self.recorded_step(per_request_scheduler or self.scheduler, noise_pred, t, latents)

    def recorded_step(self, sched, noise_pred, t, latents):
        """The recorded SDE step in place of `sched.step(noise_pred, t, latents)`, advancing `sched` as its step
        would (the recorder is made at the first step, from the schedule `sched` holds)."""
        rec = self._recording
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
