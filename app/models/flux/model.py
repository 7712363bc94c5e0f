"""FLUX.1 family: schedule, latent packing, the transformer's velocity (the guidance embedding of a
guidance-distilled model, and true CFG when asked), the trainer-side re-scoring of a stored `Trajectory`, decoding.

Everything here follows what vllm-omni 0.30.0's FLUX pipeline does, operation for operation (the timestep input
σ·1000/1000 in the latent dtype, the guidance input in fp32 (the transformer scales it by 1000), 2x2 packed latents
with 3-axis position ids (text ids all zero), the schedule shifted by the image's token count, true CFG
`neg + s·(pos − neg)` without renormalisation), so that a step scored here equals the step the rollout took.
Packing, ids and the shift are diffusers' own (`FluxPipeline._pack_latents`, `_prepare_latent_image_ids`,
`calculate_shift`), which vllm-omni's pipeline uses too.

A group's conditioning, shared by its samples: `prompt_embeds` [S, D] (T5's states, padded to T5_MAX_LENGTH; every
position is attended, so `prompt_mask` is all ones) and `conditioning["pooled_prompt_embeds"]` [P] (CLIP-L's pooled
output); under true CFG the negative prompt's too. FLUX.1-dev is guidance-distilled: `embedded_guidance_scale`
(3.5 in the field's recipes) is an input of its one forward a step.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import numpy as np
import torch
from diffusers import FluxPipeline
from diffusers.pipelines.flux.pipeline_flux import calculate_shift

from app.algo.sampling import Velocity, score_steps
from app.algo.sde import SDEStepOutput
from app.types import GenerationRequest, Trajectory

VAE_SCALE_FACTOR = 8  # 2 ** (len(block_out_channels) - 1) of FLUX's VAE
PATCH = 2  # latents are packed 2x2 into tokens
# T5 tokens a prompt is padded to: flow_grpo's FLUX recipe (train_flux.py) samples and evaluates at 128 (diffusers'
# and vllm-omni's default is 512); FLUX attends the padding too, so this is part of the conditioning
T5_MAX_LENGTH = 128
POOLED, NEGATIVE_POOLED = "pooled_prompt_embeds", "negative_pooled_prompt_embeds"  # Trajectory.conditioning keys


def latent_grid(height: int, width: int) -> tuple[int, int]:
    """(h, w) of the packed token grid: the image is 8x smaller in the VAE and 2x2-packed."""
    return height // VAE_SCALE_FACTOR // PATCH, width // VAE_SCALE_FACTOR // PATCH


def image_tokens(height: int, width: int) -> int:
    h, w = latent_grid(height, width)
    return h * w


def schedule(scheduler, num_inference_steps: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(timesteps [T], sigmas [T+1]) of FLUX's `FlowMatchEulerDiscreteScheduler` (shifted by mu of the image's token
    count) for this many steps. Uses a copy, so the caller's scheduler keeps its state."""
    sched = copy.deepcopy(scheduler)
    cfg = sched.config
    mu = calculate_shift(seq_len, cfg.get("base_image_seq_len", 256), cfg.get("max_image_seq_len", 4096),
                         cfg.get("base_shift", 0.5), cfg.get("max_shift", 1.15))
    sched.set_timesteps(sigmas=np.linspace(1.0, 1 / num_inference_steps, num_inference_steps), mu=mu, device="cpu")
    return sched.timesteps.float(), sched.sigmas.float()


def image_ids(height: int, width: int, device=None, dtype=None) -> torch.Tensor:
    """[L, 3] position ids of the packed image tokens (0, row, column)."""
    h, w = latent_grid(height, width)
    return FluxPipeline._prepare_latent_image_ids(1, h, w, device, dtype)


def initial_latents(generators: Sequence[torch.Generator], num_channels: int, height: int, width: int,
                    dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """x at σ = 1, one sample per generator: [n, L, 4C]. Same draws as both pipelines' `prepare_latents`."""
    from diffusers.utils.torch_utils import randn_tensor

    n = len(generators)
    h, w = 2 * (height // (VAE_SCALE_FACTOR * 2)), 2 * (width // (VAE_SCALE_FACTOR * 2))
    noise = randn_tensor((n, num_channels, h, w), generator=list(generators), device=torch.device(device),
                         dtype=dtype)
    return FluxPipeline._pack_latents(noise, n, num_channels, h, w)


def velocity(transformer, latents: torch.Tensor, timestep: torch.Tensor, prompt_embeds: torch.Tensor,
             pooled: torch.Tensor, ids: torch.Tensor, *, embedded_guidance: float | None,
             guidance_scale: float = 1.0, negative_prompt_embeds: torch.Tensor | None = None,
             negative_pooled: torch.Tensor | None = None) -> torch.Tensor:
    """The transformer's velocity at (latents [B, L, 4C], timestep [] or [B] on the ×1000 scale), conditioned on
    prompt_embeds [B, S, D] and pooled [B, P]; ids: the image tokens' [L, 3]. embedded_guidance: the
    guidance-distilled model's guidance input (None: a model without one). With guidance_scale > 1 (true CFG):
    v = neg + s·(pos − neg)."""
    batch = latents.shape[0]
    t = timestep.expand(batch).to(device=latents.device, dtype=latents.dtype)
    guidance = None
    if embedded_guidance is not None:
        guidance = torch.full((batch,), float(embedded_guidance), device=latents.device, dtype=torch.float32)

    def predict(embeds, pooled_embeds):
        text_ids = torch.zeros(embeds.shape[1], 3, device=latents.device, dtype=ids.dtype)
        return transformer(hidden_states=latents, timestep=t / 1000, guidance=guidance,
                           pooled_projections=pooled_embeds, encoder_hidden_states=embeds, txt_ids=text_ids,
                           img_ids=ids, return_dict=False)[0]

    pos = predict(prompt_embeds, pooled)  # [B, L, 4C]
    if guidance_scale <= 1:
        return pos
    neg = predict(negative_prompt_embeds, negative_pooled)
    return neg + guidance_scale * (pos - neg)


def group_velocity(transformer, timesteps: torch.Tensor, embeds: torch.Tensor, pooled: torch.Tensor,
                   negative_embeds: torch.Tensor | None, negative_pooled: torch.Tensor | None, *, batch: int,
                   height: int, width: int, embedded_guidance: float | None, guidance_scale: float, device,
                   dtype) -> Velocity:
    """The velocity function of `batch` samples of one prompt group (`app.algo.sampling`): v(x, i) at the
    schedule's timestep i; the group's [S, D] states and [P] pooled embedding (and negative ones under true CFG)
    are shared by every sample (expanded views)."""

    def expand(t: torch.Tensor) -> torch.Tensor:
        return t.to(device=device, dtype=dtype).unsqueeze(0).expand(batch, *t.shape)

    pos_e, pos_p = expand(embeds), expand(pooled)
    neg_e = neg_p = None
    if guidance_scale > 1:
        neg_e, neg_p = expand(negative_embeds), expand(negative_pooled)
    ids = image_ids(height, width, device, dtype)

    def v(x: torch.Tensor, i: int) -> torch.Tensor:
        return velocity(transformer, x, timesteps[i].to(device), pos_e, pos_p, ids,
                        embedded_guidance=embedded_guidance, guidance_scale=guidance_scale,
                        negative_prompt_embeds=neg_e, negative_pooled=neg_p)

    return v


def score_trajectory(transformer, traj: Trajectory, steps: Sequence[int], samples: Sequence[int] | None = None, *,
                     flow_grpo_compat: bool = False, dtype: torch.dtype | None = None) -> list[SDEStepOutput]:
    """Re-score the stored transitions x_{steps[k]} → x_{steps[k]+1} of a trajectory under `transformer`
    (`app.algo.sampling.score_steps`); differentiable when the transformer requires grad. samples: which members of
    the group (default all). One SDEStepOutput per step, each with log_prob [B] and prev_sample_mean [B, L, 4C]."""
    param = next(transformer.parameters())
    device, dtype = param.device, dtype or param.dtype
    idx = list(range(traj.group_size)) if samples is None else list(samples)
    v = group_velocity(transformer, traj.timesteps, traj.prompt_embeds, traj.conditioning[POOLED],
                       traj.negative_prompt_embeds, traj.conditioning.get(NEGATIVE_POOLED), batch=len(idx),
                       height=traj.height, width=traj.width, embedded_guidance=traj.embedded_guidance_scale,
                       guidance_scale=traj.guidance_scale, device=device, dtype=dtype)
    return score_steps(v, traj.latents[idx], steps, traj.sigmas, traj.step_noise_levels, sde_type=traj.sde_type,
                       flow_grpo_compat=flow_grpo_compat, device=device, dtype=dtype)


def decode_images(vae, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """Final packed latents [n, L, 4C] → uint8 images [n, H, W, 3] (unpacked, un-normalised, VAE-decoded, rounded),
    as both pipelines decode them."""
    x = FluxPipeline._unpack_latents(latents, height, width, VAE_SCALE_FACTOR).to(vae.dtype)
    x = x / vae.config.scaling_factor + vae.config.shift_factor
    image = vae.decode(x, return_dict=False)[0]  # [n, 3, H, W] in [-1, 1]
    image = (image / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 1).float().cpu().numpy()
    return torch.from_numpy((image * 255).round().astype("uint8"))


def shaped_trajectory(path, request: GenerationRequest, config, generator: torch.Generator) -> Trajectory:
    """A group shaped as the rollout returns it for `request`, random values (benchmarks: the cost does not depend
    on them); `config` is the transformer's."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    n, steps = request.n, request.num_inference_steps
    tokens = image_tokens(request.height, request.width)
    scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(path, subfolder="scheduler")
    timesteps, sigmas = schedule(scheduler, steps, tokens)

    def states():
        return torch.randn(T5_MAX_LENGTH, config["joint_attention_dim"], generator=generator)

    def pooled():
        return torch.randn(config["pooled_projection_dim"], generator=generator)

    mask = torch.ones(T5_MAX_LENGTH, dtype=torch.long)
    conditioning = {POOLED: pooled(), **({NEGATIVE_POOLED: pooled()} if request.do_cfg else {})}
    return Trajectory.sampled(
        request, seed=request.seed, lora_version=0, family="flux",
        images=torch.zeros(n, request.height, request.width, 3, dtype=torch.uint8),
        latents=torch.randn(n, steps + 1, tokens, config["in_channels"], generator=generator),
        log_probs=torch.zeros(n, steps), timesteps=timesteps, sigmas=sigmas, prompt_embeds=states(), prompt_mask=mask,
        negative_prompt_embeds=states() if request.do_cfg else None, negative_prompt_mask=mask,
        conditioning=conditioning)
