"""Wan family (text to video): schedule, video latents, the transformer's velocity (CFG or not), the trainer-side
re-scoring of a stored `Trajectory`, decoding to frames.

Everything here follows what diffusers' `WanPipeline` does, operation for operation, so that a step scored here
equals the step the rollout took:
- latents are fp32 [C, F', h, w] a sample (F' = (F − 1)/4 + 1 latent frames of a video of F frames, h, w = H/s, W/s
  for the VAE's spatial factor s), unpacked: the transformer patchifies (1, 2, 2) itself; they are cast to the
  transformer's dtype for each forward, and the trainer feeds them the same way (fp32 in, cast inside);
- the transformer takes the timestep σ·1000, one a sample (Wan2.1), or one a latent token (Wan2.2-TI2V,
  `expand_timesteps` in the pipeline's config: the same value everywhere in text to video); its output is the
  velocity;
- CFG is `neg + s·(pos − neg)`, a forward for each branch as the pipeline makes them, combined in fp32;
- the schedule: σ linear from 1 to 1/T over T points, shifted by the checkpoint's `flow_shift` (Wan's UniPC config;
  `shift` in an Euler config), then 0: the points Wan's own UniPC scheduler visits (within 2e-3: its line starts at
  1 − 1/1000), DanceGRPO's and SD3's. Not the Euler scheduler's default line to 1/1000, whose last SDE step would jump
  to σ ≈ 0.003 with its noise and leave the noise there (`WanPipeline` with an Euler scheduler samples on that line:
  `euler_scheduler` below is the Euler scheduler on this one, for the stock pipeline's comparison).

A group's conditioning, shared by its samples: `prompt_embeds` [S, D], UMT5's states of the prompt padded with zeros
to S = 512 (what the transformer attends to: all S rows, so `prompt_mask` is all ones), and under CFG the negative
prompt's.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch

from app.algo.sampling import Velocity, score_steps
from app.algo.sde import SDEStepOutput
from app.types import GenerationRequest, Trajectory

PATCH = (1, 2, 2)  # (frames, rows, columns) of a latent patch: every Wan transformer's
TEMPORAL_FACTOR = 4  # the VAE's frames per latent frame (after the first)
# UMT5 tokens of a prompt: the pipelines pad (and cut, silently) to this many
MAX_SEQUENCE_LENGTH = 512


def pipeline_settings(path: str | Path) -> dict:
    """What the checkpoint's `model_index.json` and scheduler config fix for sampling: `expand_timesteps` (Wan2.2-TI2V
    feeds one timestep a token) and `flow_shift`."""
    index = json.loads((Path(path) / "model_index.json").read_text())
    scheduler = json.loads((Path(path) / "scheduler" / "scheduler_config.json").read_text())
    shift = scheduler.get("flow_shift", scheduler.get("shift"))
    if shift is None:
        raise ValueError(f"{path}/scheduler: neither flow_shift (UniPC) nor shift (Euler) is set: Wan's schedule "
                         "needs one")
    return {"expand_timesteps": bool(index.get("expand_timesteps", False)), "flow_shift": float(shift)}


def base_sigmas(num_inference_steps: int) -> list[float]:
    """The σ points before the shift: linear from 1 to 1/T."""
    return torch.linspace(1.0, 1 / num_inference_steps, num_inference_steps).tolist()


def euler_scheduler(flow_shift: float):
    """diffusers' flow-matching Euler scheduler that sets Wan's schedule whatever a pipeline asks of it (`WanPipeline`
    calls `set_timesteps(T)` and would get the default line)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    class WanEuler(FlowMatchEulerDiscreteScheduler):
        def set_timesteps(self, num_inference_steps=None, device=None, **_):
            super().set_timesteps(sigmas=base_sigmas(num_inference_steps), device=device)

    return WanEuler(num_train_timesteps=1000, shift=flow_shift)


def schedule(flow_shift: float, num_inference_steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(timesteps [T] = σ·1000, sigmas [T+1]) of Wan's schedule shifted by `flow_shift`."""
    scheduler = euler_scheduler(flow_shift)
    scheduler.set_timesteps(num_inference_steps, device="cpu")
    return scheduler.timesteps.float(), scheduler.sigmas.float()


def latent_frames(num_frames: int) -> int:
    return (num_frames - 1) // TEMPORAL_FACTOR + 1


def frames_problem(num_frames) -> str | None:
    """Why a frame count cannot be sampled by Wan's VAE, or None."""
    if not isinstance(num_frames, int) or isinstance(num_frames, bool) or num_frames < 1 or (
            num_frames - 1) % TEMPORAL_FACTOR:
        return "must be 4k + 1 frames (1, 5, ..., 33, ..., 81): Wan's VAE encodes 1 + 4 per latent frame"
    return None


def latent_shape(num_channels: int, num_frames: int, height: int, width: int, spatial: int) -> tuple[int, ...]:
    return num_channels, latent_frames(num_frames), height // spatial, width // spatial


def video_tokens(latent: Sequence[int]) -> int:
    """Transformer tokens of a latent [C, F', h, w]."""
    _, f, h, w = latent
    return (f // PATCH[0]) * (h // PATCH[1]) * (w // PATCH[2])


def initial_latents(generators: Sequence[torch.Generator], shape: Sequence[int],
                    device: torch.device | str = "cpu") -> torch.Tensor:
    """x at σ = 1, one sample per generator: [n, C, F', h, w] fp32. Same draws as the pipeline's `prepare_latents`."""
    from diffusers.utils.torch_utils import randn_tensor

    return randn_tensor((len(generators), *shape), generator=list(generators), device=torch.device(device),
                        dtype=torch.float32)


def velocity(transformer, latents: torch.Tensor, timestep: torch.Tensor, embeds: torch.Tensor, *,
             dtype: torch.dtype, expand_timesteps: bool = False, guidance_scale: float = 1.0,
             negative_embeds: torch.Tensor | None = None) -> torch.Tensor:
    """The velocity [B, C, F', h, w] fp32 at (latents [B, C, F', h, w] fp32, timestep [] on the ×1000 σ scale), the
    prompt's states [B, S, D] (and the negative prompt's under CFG, guidance_scale s > 1), the transformer computing
    in `dtype`."""
    batch = latents.shape[0]
    x = latents.to(dtype)
    t = timestep.to(device=latents.device)
    t = t.expand(batch, video_tokens(latents.shape[1:])) if expand_timesteps else t.expand(batch)

    def forward(states: torch.Tensor) -> torch.Tensor:
        return transformer(hidden_states=x, timestep=t, encoder_hidden_states=states, return_dict=False)[0].float()

    pred = forward(embeds)
    if guidance_scale > 1:
        uncond = forward(negative_embeds)
        pred = uncond + guidance_scale * (pred - uncond)
    return pred


def group_velocity(transformer, timesteps: torch.Tensor, embeds: torch.Tensor, negative_embeds: torch.Tensor | None,
                   *, batch: int, guidance_scale: float, expand_timesteps: bool, device, dtype) -> Velocity:
    """The velocity function of `batch` samples of one prompt group (`app.algo.sampling`): v(x, i) at the
    schedule's timestep i; the group's states [S, D] (and the negative ones under CFG) are every sample's."""
    states = embeds.to(device=device, dtype=dtype).expand(batch, -1, -1)
    negative = None
    if guidance_scale > 1:
        negative = negative_embeds.to(device=device, dtype=dtype).expand(batch, -1, -1)

    def v(x: torch.Tensor, i: int) -> torch.Tensor:
        return velocity(transformer, x, timesteps[i], states, dtype=dtype, expand_timesteps=expand_timesteps,
                        guidance_scale=guidance_scale, negative_embeds=negative)

    return v


def score_trajectory(transformer, traj: Trajectory, steps: Sequence[int], samples: Sequence[int] | None = None, *,
                     flow_grpo_compat: bool = False, dtype: torch.dtype | None = None) -> list[SDEStepOutput]:
    """Re-score the stored transitions x_{steps[k]} → x_{steps[k]+1} of a trajectory under `transformer`
    (`app.algo.sampling.score_steps`); differentiable when the transformer requires grad. The latents are fed in
    fp32, as the rollout kept them, and cast to the transformer's dtype inside `velocity`."""
    # diffusers' dtype, not the first parameter's: Wan keeps its norms, time embedder and scale_shift_table (its first
    # parameter) in fp32, and a bf16 patch embedding then met fp32 latents
    device, dtype = next(transformer.parameters()).device, dtype or transformer.dtype
    idx = list(range(traj.group_size)) if samples is None else list(samples)
    v = group_velocity(transformer, traj.timesteps, traj.prompt_embeds, traj.negative_prompt_embeds, batch=len(idx),
                       guidance_scale=traj.guidance_scale,
                       expand_timesteps=bool(traj.conditioning.get("expand_timesteps", torch.zeros(())).item()),
                       device=device, dtype=dtype)
    return score_steps(v, traj.latents[idx], steps, traj.sigmas, traj.step_noise_levels, sde_type=traj.sde_type,
                       flow_grpo_compat=flow_grpo_compat, device=device, dtype=torch.float32)


def decode_videos(vae, latents: torch.Tensor) -> torch.Tensor:
    """Final latents [n, C, F', h, w] → uint8 frames [n, F, H, W, 3] (un-normalised, VAE-decoded, rounded), as the
    pipeline decodes them: the group in one batch (Wan's causal decoder keeps its frame cache per batch; a video at
    a time made the tiny Wan's learning test cost 39 % more CPU)."""
    cfg = vae.config
    mean = torch.tensor(cfg.latents_mean).view(1, cfg.z_dim, 1, 1, 1).to(latents.device, vae.dtype)
    inv_std = 1.0 / torch.tensor(cfg.latents_std).view(1, cfg.z_dim, 1, 1, 1).to(latents.device, vae.dtype)
    videos = vae.decode(latents.to(vae.dtype) / inv_std + mean, return_dict=False)[0]  # [n, 3, F, H, W] in [-1, 1]
    videos = (videos / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 4, 1).float().cpu().numpy()
    return torch.from_numpy((videos * 255).round().astype("uint8"))


def shaped_trajectory(path, request: GenerationRequest, config, generator: torch.Generator) -> Trajectory:
    """A group shaped as the rollout returns it for `request`, random values (benchmarks: the cost does not depend
    on them); `config` is the transformer's."""
    from diffusers import AutoencoderKLWan

    settings = pipeline_settings(path)
    spatial = AutoencoderKLWan.load_config(Path(path) / "vae").get("scale_factor_spatial", 8)
    n, steps = request.n, request.num_inference_steps
    shape = latent_shape(config["in_channels"], request.num_frames, request.height, request.width, spatial)
    timesteps, sigmas = schedule(settings["flow_shift"], steps)

    def states():
        return torch.randn(MAX_SEQUENCE_LENGTH, config["text_dim"], generator=generator)

    mask = torch.ones(MAX_SEQUENCE_LENGTH, dtype=torch.long)
    return Trajectory.sampled(
        request, seed=request.seed, lora_version=0, family="wan",
        images=torch.zeros(n, request.num_frames, request.height, request.width, 3, dtype=torch.uint8),
        latents=torch.randn(n, steps + 1, *shape, generator=generator), log_probs=torch.zeros(n, steps),
        timesteps=timesteps, sigmas=sigmas, prompt_embeds=states(), prompt_mask=mask,
        negative_prompt_embeds=states() if request.do_cfg else None,
        negative_prompt_mask=mask.clone() if request.do_cfg else None,
        conditioning=conditioning(settings["expand_timesteps"]))


def conditioning(expand_timesteps: bool) -> dict[str, torch.Tensor]:
    """What a Wan trajectory carries beside its text states: how its transformer took the timestep."""
    return {"expand_timesteps": torch.tensor(expand_timesteps)}
