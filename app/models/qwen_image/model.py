"""Qwen-Image family: schedule, latent packing, the transformer's velocity with true CFG, and the trainer-side
recompute of rollout log-probs from a stored `Trajectory`.

Everything here follows what vllm-omni 0.30.0's Qwen-Image pipeline does, operation for operation (timestep
input t/1000 in the latent dtype, CFG `neg + s·(pos − neg)` rescaled to the conditional norm, 2x2 latent packing),
so that a step scored here equals the step the rollout took: the parity the on-policy ratio depends on.
Packing and the resolution shift are diffusers' own (`QwenImagePipeline._pack_latents`, `calculate_shift`).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import numpy as np
import torch
from diffusers import QwenImagePipeline
from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift

from app.algo.sampling import Velocity, score_steps
from app.algo.sde import SDEStepOutput
from app.types import GenerationRequest, Trajectory

VAE_SCALE_FACTOR = 8  # 2 ** len(temperal_downsample) of the Qwen-Image VAE
PATCH = 2  # latents are packed 2x2 into tokens


def latent_grid(height: int, width: int, vae_scale_factor: int = VAE_SCALE_FACTOR) -> tuple[int, int]:
    """(h, w) of the packed token grid: the image is 8x smaller in the VAE and 2x2-patched."""
    return height // vae_scale_factor // PATCH, width // vae_scale_factor // PATCH


def image_seq_len(height: int, width: int, vae_scale_factor: int = VAE_SCALE_FACTOR) -> int:
    h, w = latent_grid(height, width, vae_scale_factor)
    return h * w


def img_shapes(batch: int, height: int, width: int, vae_scale_factor: int = VAE_SCALE_FACTOR) -> list:
    return [[(1, *latent_grid(height, width, vae_scale_factor))]] * batch


def schedule(scheduler, num_inference_steps: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(timesteps [T], sigmas [T+1]) of a `FlowMatchEulerDiscreteScheduler` for this many steps and tokens.

    Uses a copy, so the caller's scheduler keeps its state. sigmas[0] = 1 and sigmas[T] = 0.
    """
    sched = copy.deepcopy(scheduler)
    cfg = sched.config
    mu = calculate_shift(seq_len, cfg.get("base_image_seq_len", 256), cfg.get("max_image_seq_len", 4096),
                          cfg.get("base_shift", 0.5), cfg.get("max_shift", 1.15))
    sched.set_timesteps(sigmas=np.linspace(1.0, 1 / num_inference_steps, num_inference_steps), mu=mu, device="cpu")
    return sched.timesteps.float(), sched.sigmas.float()


def unpack_latents(tokens: torch.Tensor, height: int, width: int,
                   vae_scale_factor: int = VAE_SCALE_FACTOR) -> torch.Tensor:
    """[B, L, 4C] → [B, C, 1, h, w] (the VAE's 5-D layout with one frame)."""
    return QwenImagePipeline._unpack_latents(tokens, height, width, vae_scale_factor)


def initial_latents(generators: Sequence[torch.Generator], num_channels: int, height: int, width: int,
                    dtype: torch.dtype, device: torch.device | str = "cpu",
                    vae_scale_factor: int = VAE_SCALE_FACTOR) -> torch.Tensor:
    """x at σ = 1, one sample per generator: [n, L, 4C]. Same draws as vllm-omni's `prepare_latents`."""
    from diffusers.utils.torch_utils import randn_tensor

    n = len(generators)
    h, w = 2 * (height // (vae_scale_factor * 2)), 2 * (width // (vae_scale_factor * 2))
    noise = randn_tensor((n, 1, num_channels, h, w), generator=list(generators), device=torch.device(device),
                         dtype=dtype)  # [n, 1, C, h, w]
    return QwenImagePipeline._pack_latents(noise, n, num_channels, h, w)  # [n, L, 4C]


def velocity(
    transformer,
    latents: torch.Tensor,
    timestep: torch.Tensor,
    prompt_embeds: torch.Tensor,
    prompt_mask: torch.Tensor,
    shapes: list,
    *,
    guidance_scale: float = 1.0,
    negative_prompt_embeds: torch.Tensor | None = None,
    negative_prompt_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """The transformer's velocity at (latents [B, L, 4C], timestep [] or [B] on the ×1000 scale).

    With guidance_scale > 1 (Qwen-Image "true CFG"): v = neg + s·(pos − neg), rescaled per token to ‖pos‖.
    """
    t = timestep.expand(latents.shape[0]).to(device=latents.device, dtype=latents.dtype)

    def predict(embeds, mask):
        return transformer(hidden_states=latents, timestep=t / 1000, guidance=None, encoder_hidden_states_mask=mask,
                           encoder_hidden_states=embeds, img_shapes=shapes, return_dict=False)[0]

    pos = predict(prompt_embeds, prompt_mask)  # [B, L, 4C]
    if guidance_scale <= 1:
        return pos
    neg = predict(negative_prompt_embeds, negative_prompt_mask)  # [B, L, 4C]
    comb = neg + guidance_scale * (pos - neg)
    return comb * (torch.norm(pos, dim=-1, keepdim=True) / torch.norm(comb, dim=-1, keepdim=True))


def _batch_embeds(embeds: torch.Tensor, mask: torch.Tensor, batch: int, device, dtype):
    """A group's [S, D] embeddings and [S] mask repeated for a batch of its samples (views). A mask of ones (a
    group is one prompt: no padding) becomes None, as vllm-omni's transformer and diffusers' `encode_prompt` make
    it: attention then runs without a bias, in the GPU's flash kernels, and a compiled block is not guarded on the
    text length's alignment (a masked CUDA attention pads its bias to a multiple of 8: a prompt of the other
    residue compiled the trainer again mid-run)."""
    embeds = embeds.to(device=device, dtype=dtype).unsqueeze(0).expand(batch, -1, -1)
    if bool(mask.bool().all()):
        return embeds, None
    return embeds, mask.to(device=device).unsqueeze(0).expand(batch, -1)


def group_velocity(transformer, timesteps: torch.Tensor, embeds: torch.Tensor, mask: torch.Tensor,
                   negative_embeds: torch.Tensor | None, negative_mask: torch.Tensor | None, *, batch: int,
                   height: int, width: int, guidance_scale: float, device, dtype) -> Velocity:
    """The velocity function of `batch` samples of one prompt group (`app.algo.sampling`): v(x, i) at the
    schedule's timestep i; the group's [S, D] prompt states (and negative ones under CFG) are shared by every
    sample."""
    shapes = img_shapes(batch, height, width)
    pos_e, pos_m = _batch_embeds(embeds, mask, batch, device, dtype)
    neg_e = neg_m = None
    if guidance_scale > 1:
        neg_e, neg_m = _batch_embeds(negative_embeds, negative_mask, batch, device, dtype)

    def v(x: torch.Tensor, i: int) -> torch.Tensor:
        return velocity(transformer, x, timesteps[i].to(device), pos_e, pos_m, shapes, guidance_scale=guidance_scale,
                        negative_prompt_embeds=neg_e, negative_prompt_mask=neg_m)

    return v


def score_trajectory(transformer, traj: Trajectory, steps: Sequence[int], samples: Sequence[int] | None = None, *,
                     flow_grpo_compat: bool = False, dtype: torch.dtype | None = None) -> list[SDEStepOutput]:
    """Re-score the stored transitions x_{steps[k]} → x_{steps[k]+1} of a trajectory under `transformer`
    (`app.algo.sampling.score_steps`).

    The transformer may carry a peft LoRA (enabled or disabled by the caller) and may require grad: the returned
    log-probs and means are differentiable. samples: which members of the group (default all).
    Returns one SDEStepOutput per step, each with log_prob [B] and prev_sample_mean [B, L, 4C].
    """
    param = next(transformer.parameters())
    device, dtype = param.device, dtype or param.dtype
    idx = list(range(traj.group_size)) if samples is None else list(samples)
    v = group_velocity(transformer, traj.timesteps, traj.prompt_embeds, traj.prompt_mask,
                       traj.negative_prompt_embeds, traj.negative_prompt_mask, batch=len(idx), height=traj.height,
                       width=traj.width, guidance_scale=traj.guidance_scale, device=device, dtype=dtype)
    return score_steps(v, traj.latents[idx], steps, traj.sigmas, traj.step_noise_levels, sde_type=traj.sde_type,
                       flow_grpo_compat=flow_grpo_compat, device=device, dtype=dtype)


def decode_images(vae, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """Packed final latents [n, L, 4C] → uint8 images [n, H, W, 3] (de-normalised, VAE-decoded, rounded)."""
    x = unpack_latents(latents, height, width).to(vae.dtype)  # [n, C, 1, h, w]
    z = vae.config.z_dim
    mean = torch.tensor(vae.config.latents_mean).view(1, z, 1, 1, 1).to(x.device, x.dtype)
    inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, z, 1, 1, 1).to(x.device, x.dtype)
    x = x / inv_std + mean
    image = vae.decode(x, return_dict=False)[0][:, :, 0]  # [n, 3, H, W] in [-1, 1]
    image = (image / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 1).float().cpu().numpy()
    return torch.from_numpy((image * 255).round().astype("uint8"))


def shaped_trajectory(path, request: GenerationRequest, config, generator: torch.Generator,
                      text_tokens: int = 64) -> Trajectory:
    """A group shaped as the rollout returns it for `request`, random values (benchmarks: the cost does not depend
    on them); `config` is the transformer's, `text_tokens` the prompt's states (an OCR prompt under Qwen's
    template: about 64)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    n, steps = request.n, request.num_inference_steps
    tokens = image_seq_len(request.height, request.width)
    scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(path, subfolder="scheduler")
    timesteps, sigmas = schedule(scheduler, steps, tokens)

    def states():
        return torch.randn(text_tokens, config["joint_attention_dim"], generator=generator)

    mask = torch.ones(text_tokens, dtype=torch.long)
    return Trajectory.sampled(
        request, seed=request.seed, lora_version=0, images=torch.zeros(n, request.height, request.width, 3,
                                                                        dtype=torch.uint8),
        latents=torch.randn(n, steps + 1, tokens, config["in_channels"], generator=generator),
        log_probs=torch.zeros(n, steps), timesteps=timesteps, sigmas=sigmas, prompt_embeds=states(), prompt_mask=mask,
        negative_prompt_embeds=states() if request.do_cfg else None, negative_prompt_mask=mask)
