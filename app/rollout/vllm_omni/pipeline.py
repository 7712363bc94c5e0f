"""vllm-omni's Qwen-Image pipeline with the FlowGRPO sampler and trajectory recording.

Loaded by vllm-omni through `custom_pipeline_args={"pipeline_class": ...}`. Per request it reads the
`flowgrpo` entry of `sampling_params.extra_args` (seed, sample_offset, noise_level, sde_type, sde_window), draws
the initial latents and every SDE step's noise from per-sample generators (app/rollout/seeding.py), replaces the
scheduler step with `app.algo.sde.sde_step`, and returns through vllm-omni's trajectory fields:

    trajectory_latents    [n, T+1, L, C] fp32   x at every sigma, as the transformer saw it
    trajectory_log_probs  [n, T] fp32           log-prob of each taken step
    trajectory_timesteps  dict: timesteps [T], sigmas [T+1], prompt_embeds [S, D], prompt_mask [S]
                          (+ negative ones under CFG): what the trainer needs to score the same steps

Requests without a `flowgrpo` entry run the stock pipeline. The step-wise execution path is switched off: it
would bypass the SDE step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from vllm_omni.diffusion.models.qwen_image.pipeline_qwen_image import QwenImagePipeline

from app.algo.sde import sde_step
from app.algo.sde_window import noise_levels
from app.rollout.seeding import sample_generators

EXTRA_ARGS_KEY = "flowgrpo"


@dataclass
class _Recording:
    """What one forward (possibly several batched requests) records, in batch order (request-major)."""

    generators: list[torch.Generator]
    noise_level: float
    sde_type: str
    sde_window: tuple[int, int] | None  # steps outside it take the ODE step (app/algo/sde_window.py)
    latents: list[torch.Tensor] = field(default_factory=list)  # T+1 × [B, L, C]
    log_probs: list[torch.Tensor] = field(default_factory=list)  # T × [B]
    timesteps: list[torch.Tensor] = field(default_factory=list)  # T × []
    sigmas: torch.Tensor | None = None  # [T+1]
    embeds: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # name → (embeds, mask)


def _window(args: dict) -> tuple[int, int] | None:
    window = args.get("sde_window")
    return None if window is None else (int(window[0]), int(window[1]))


def _flowgrpo_args(sampling_params) -> dict | None:
    extra = getattr(sampling_params, "extra_args", None) or {}
    return extra.get(EXTRA_ARGS_KEY)


class FlowGRPOQwenImagePipeline(QwenImagePipeline):
    supports_step_execution = False  # the step-wise path calls the stock scheduler step
    _progress_bar_config = {"disable": True}  # a server's per-request denoising bars are noise in every log
    _recording: _Recording | None = None

    def forward(self, req):
        params = req.sampling_params_list
        args = [_flowgrpo_args(p) for p in params]
        if all(a is None for a in args):
            return super().forward(req)
        if any(a is None for a in args):
            raise ValueError("FlowGRPO and plain requests cannot share a batch")
        if len({(a["noise_level"], a["sde_type"], _window(a)) for a in args}) != 1:
            raise ValueError("requests batched together must share noise_level, sde_type and sde_window")
        n = params[0].num_outputs_per_prompt if params[0].num_outputs_per_prompt > 0 else 1
        generators = [g for a in args for g in sample_generators(a["seed"], a["sample_offset"], n)]
        self._recording = rec = _Recording(generators, float(args[0]["noise_level"]), args[0]["sde_type"],
                                           _window(args[0]))
        try:
            outputs = super().forward(req)
        finally:
            self._recording = None
        latents = torch.stack(rec.latents, dim=1).float().cpu()  # [B, T+1, L, C]
        log_probs = torch.stack(rec.log_probs, dim=1).cpu()  # [B, T]
        timesteps = torch.stack([t.reshape(()) for t in rec.timesteps]).float().cpu()  # [T]
        for r, out in enumerate(outputs):
            group = slice(r * n, (r + 1) * n)
            side = {"timesteps": timesteps, "sigmas": rec.sigmas}
            for name, (embeds, mask) in rec.embeds.items():
                valid = mask[r * n].bool().cpu()  # drop the padding of batched prompts of unequal length
                side[f"{name}_embeds"] = embeds[r * n].float().cpu()[valid]
                side[f"{name}_mask"] = mask[r * n].cpu()[valid].long()
            out.trajectory_latents = latents[group]
            out.trajectory_log_probs = log_probs[group]
            out.trajectory_timesteps = side
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
        i = sched.step_index
        sigmas = sched.sigmas
        if i == 0:
            rec.sigmas = sigmas.float().cpu()
            rec.latents.append(latents.detach().float())
        level = noise_levels(rec.noise_level, len(sigmas) - 1, rec.sde_window)[i]
        step = sde_step(noise_pred, latents, sigmas[i], sigmas[i + 1], noise_level=level,
                        sde_type=rec.sde_type, sigma_max=sigmas[1], generator=rec.generators,
                        sample_dtype=latents.dtype)
        prev = step.prev_sample.to(latents.dtype)  # exact: already rounded to this dtype, then scored
        sched._step_index += 1
        rec.latents.append(prev.detach().float())
        rec.log_probs.append(step.log_prob.detach())
        rec.timesteps.append(t.detach())
        return prev

    # LoRA tensors staged in memory by the worker extension; vllm-omni's LoRA manager asks this hook first and
    # reads a PEFT folder from lora_request.lora_path only when it returns None.
    def _load_diffusion_lora_adapter(self, *, lora_request, lora_path, dtype):
        staged = getattr(self, "_staged_loras", {}).get(lora_request.lora_int_id)
        if staged is None:
            return None
        from vllm.lora.lora_model import LoRAModel
        from vllm.lora.peft_helper import PEFTHelper

        tensors, peft_config = staged
        helper = PEFTHelper.from_dict(dict(peft_config))
        model = LoRAModel.from_lora_tensors(lora_model_id=lora_request.lora_int_id, tensors=tensors,
                                            peft_helper=helper, device="cpu", dtype=dtype)
        return model, helper
