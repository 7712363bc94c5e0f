"""Stable Diffusion 3 family: schedule, initial noise, the MMDiT's velocity with CFG, the trainer-side re-scoring
of a stored `Trajectory`, and decoding.

Everything here follows what vllm-omni 0.30.0's SD3 pipeline does, operation for operation (the scheduler's own
timesteps σ·1000 as the model's input in the latent dtype, CFG `neg + s·(pos − neg)` from two forwards without
renormalisation, latents [B, 16, H/8, W/8] unpacked: the MMDiT patchifies them itself), so that a step scored here
equals the step the rollout took: the parity the on-policy ratio depends on.

A group's conditioning, shared by its samples: `prompt_embeds` [S, 4096] (the two CLIPs' penultimate states,
zero-padded to T5's width, then T5's: S = 77 + T5_MAX_LENGTH; every position is attended, so `prompt_mask` is all
ones) and `conditioning["pooled_prompt_embeds"]` [2048] (the CLIPs' pooled projections side by side); under CFG
the negative prompt's as `negative_prompt_embeds` and `conditioning["negative_pooled_prompt_embeds"]`.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch

from app.algo.sampling import Velocity, score_steps
from app.algo.sde import SDEStepOutput
from app.types import GenerationRequest, Trajectory

VAE_SCALE_FACTOR = 8  # 2 ** (len(block_out_channels) - 1) of SD3's VAE
PATCH = 2  # the MMDiT's patch size: a 512² image is 64x64 latents, 32x32 = 1024 image tokens
T5_MAX_LENGTH = 128  # T5 tokens a prompt is padded to (flow_grpo's SD3 recipes; diffusers' default is 256)
POOLED, NEGATIVE_POOLED = "pooled_prompt_embeds", "negative_pooled_prompt_embeds"  # Trajectory.conditioning keys


def latent_shape(height: int, width: int, channels: int = 16) -> tuple[int, int, int]:
    return channels, height // VAE_SCALE_FACTOR, width // VAE_SCALE_FACTOR


def image_tokens(height: int, width: int) -> int:
    return (height // VAE_SCALE_FACTOR // PATCH) * (width // VAE_SCALE_FACTOR // PATCH)


def schedule(scheduler, num_inference_steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(timesteps [T], sigmas [T+1]) of SD3's `FlowMatchEulerDiscreteScheduler` (a fixed shift, 3.0 for SD3.5; no
    resolution-dependent shift) for this many steps. Uses a copy, so the caller's scheduler keeps its state."""
    sched = copy.deepcopy(scheduler)
    sched.set_timesteps(num_inference_steps, device="cpu")
    return sched.timesteps.float(), sched.sigmas.float()


def initial_latents(generators: Sequence[torch.Generator], channels: int, height: int, width: int,
                    dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """x at σ = 1, one sample per generator: [n, C, H/8, W/8]. Same draws as both pipelines' `prepare_latents`."""
    from diffusers.utils.torch_utils import randn_tensor

    return randn_tensor((len(generators), *latent_shape(height, width, channels)), generator=list(generators),
                        device=torch.device(device), dtype=dtype)


def velocity(transformer, latents: torch.Tensor, timestep: torch.Tensor, prompt_embeds: torch.Tensor,
             pooled: torch.Tensor, *, guidance_scale: float = 1.0, negative_prompt_embeds: torch.Tensor | None = None,
             negative_pooled: torch.Tensor | None = None) -> torch.Tensor:
    """The MMDiT's velocity at (latents [B, C, h, w], timestep [] or [B] on the ×1000 scale), conditioned on
    prompt_embeds [B, S, D] and pooled [B, P]. With guidance_scale > 1: v = neg + s·(pos − neg)."""
    t = timestep.expand(latents.shape[0]).to(device=latents.device, dtype=latents.dtype)

    def predict(embeds, pooled_embeds):
        return transformer(hidden_states=latents, timestep=t, encoder_hidden_states=embeds,
                           pooled_projections=pooled_embeds, return_dict=False)[0]

    pos = predict(prompt_embeds, pooled)  # [B, C, h, w]
    if guidance_scale <= 1:
        return pos
    neg = predict(negative_prompt_embeds, negative_pooled)
    return neg + guidance_scale * (pos - neg)


def group_velocity(transformer, timesteps: torch.Tensor, embeds: torch.Tensor, pooled: torch.Tensor,
                   negative_embeds: torch.Tensor | None, negative_pooled: torch.Tensor | None, *, batch: int,
                   guidance_scale: float, device, dtype) -> Velocity:
    """The velocity function of `batch` samples of one prompt group (`app.algo.sampling`): v(x, i) at the
    schedule's timestep i; the group's [S, D] states and [P] pooled embedding (and negative ones under CFG) are
    shared by every sample (expanded views)."""

    def expand(t: torch.Tensor) -> torch.Tensor:
        return t.to(device=device, dtype=dtype).unsqueeze(0).expand(batch, *t.shape)

    pos_e, pos_p = expand(embeds), expand(pooled)
    neg_e = neg_p = None
    if guidance_scale > 1:
        neg_e, neg_p = expand(negative_embeds), expand(negative_pooled)

    def v(x: torch.Tensor, i: int) -> torch.Tensor:
        return velocity(transformer, x, timesteps[i].to(device), pos_e, pos_p, guidance_scale=guidance_scale,
                        negative_prompt_embeds=neg_e, negative_pooled=neg_p)

    return v


def score_trajectory(transformer, traj: Trajectory, steps: Sequence[int], samples: Sequence[int] | None = None, *,
                     flow_grpo_compat: bool = False, dtype: torch.dtype | None = None) -> list[SDEStepOutput]:
    """Re-score the stored transitions x_{steps[k]} → x_{steps[k]+1} of a trajectory under `transformer`
    (`app.algo.sampling.score_steps`); differentiable when the transformer requires grad (a peft LoRA on it, enabled
    or disabled by the caller). samples: which members of the group (default all). One SDEStepOutput per step, each
    with log_prob [B] and prev_sample_mean [B, C, h, w]."""
    param = next(transformer.parameters())
    device, dtype = param.device, dtype or param.dtype
    idx = list(range(traj.group_size)) if samples is None else list(samples)
    v = group_velocity(transformer, traj.timesteps, traj.prompt_embeds, traj.conditioning[POOLED],
                       traj.negative_prompt_embeds, traj.conditioning.get(NEGATIVE_POOLED), batch=len(idx),
                       guidance_scale=traj.guidance_scale, device=device, dtype=dtype)
    return score_steps(v, traj.latents[idx], steps, traj.sigmas, traj.step_noise_levels, sde_type=traj.sde_type,
                       flow_grpo_compat=flow_grpo_compat, device=device, dtype=dtype)


def decode_images(vae, latents: torch.Tensor) -> torch.Tensor:
    """Final latents [n, C, h, w] → uint8 images [n, H, W, 3] (un-normalised, VAE-decoded, rounded), as both
    pipelines decode them."""
    x = latents.to(vae.dtype) / vae.config.scaling_factor + vae.config.shift_factor
    image = vae.decode(x, return_dict=False)[0]  # [n, 3, H, W] in [-1, 1]
    image = (image / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 1).float().cpu().numpy()
    return torch.from_numpy((image * 255).round().astype("uint8"))


def shaped_trajectory(path, request: GenerationRequest, config, generator: torch.Generator) -> Trajectory:
    """A group shaped as the rollout returns it for `request`, random values (benchmarks: the cost does not depend
    on them); `config` is the transformer's."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    n, steps = request.n, request.num_inference_steps
    timesteps, sigmas = schedule(FlowMatchEulerDiscreteScheduler.from_pretrained(path, subfolder="scheduler"), steps)
    text = 77 + T5_MAX_LENGTH

    def states():
        return torch.randn(text, config["joint_attention_dim"], generator=generator)

    def pooled():
        return torch.randn(config["pooled_projection_dim"], generator=generator)

    mask = torch.ones(text, dtype=torch.long)
    conditioning = {POOLED: pooled(), **({NEGATIVE_POOLED: pooled()} if request.do_cfg else {})}
    return Trajectory.sampled(
        request, seed=request.seed, lora_version=0, family="sd3",
        images=torch.zeros(n, request.height, request.width, 3, dtype=torch.uint8),
        latents=torch.randn(n, steps + 1, *latent_shape(request.height, request.width, config["in_channels"]),
                            generator=generator),
        log_probs=torch.zeros(n, steps), timesteps=timesteps, sigmas=sigmas, prompt_embeds=states(), prompt_mask=mask,
        negative_prompt_embeds=states() if request.do_cfg else None, negative_prompt_mask=mask,
        conditioning=conditioning)
