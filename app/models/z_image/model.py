"""Z-Image family: schedule, latents, the transformer's velocity (CFG or not), the trainer-side re-scoring of a
stored `Trajectory`, decoding.

Everything here follows what diffusers' `ZImagePipeline` and vllm-omni 0.30.0's Z-Image pipeline do, operation for
operation, so that a step scored here equals the step the rollout took:
- latents stay fp32 between steps ([C, H/8, W/8] a sample, unpacked: the transformer patchifies 2x2 itself) and are
  cast to the transformer's dtype for each forward; the trainer feeds them the same way (fp32 in, cast inside);
- the transformer takes lists (one latent [C, 1, h, w] and one caption [S_i, D] a sample: captions keep their own
  lengths, no padding) and the timestep 1 − σ (`(1000 − t) / 1000`); its output is the negative velocity;
- CFG is Z-Image's `pos + g·(pos − neg)` in fp32 with g = s − 1 for our guidance scale s (s ≤ 1: one forward):
  `rollout.guidance_scale` means what it means for every family, `neg + s·(pos − neg)`, so Z-Image's own
  `guidance_scale=g` is s = g + 1 here (Z-Image-Turbo: g = 0, s = 1);
- the schedule: linear σ from 1 to 1/N (float32), shifted by the scheduler (Z-Image-Turbo's: by 3, whatever the
  image's size).

A group's conditioning, shared by its samples: `prompt_embeds` [S, D], the second-to-last hidden states of the
Qwen3 text encoder at the chat-wrapped prompt's S tokens (no padding: `prompt_mask` is all ones), and under CFG the
negative prompt's [S', D].
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from app.algo.sampling import Velocity, score_steps
from app.algo.sde import SDEStepOutput
from app.types import GenerationRequest, Trajectory

VAE_SCALE_FACTOR = 8
PATCH = 2  # the transformer patchifies latents 2x2 (all_patch_size)
# Qwen3 tokens of the chat-wrapped prompt: both pipelines' max_sequence_length (longer ones are cut silently)
MAX_SEQUENCE_LENGTH = 512
TYPICAL_PROMPT_TOKENS = 48  # a chat-wrapped OCR prompt, for benchmarks' shaped trajectories


def default_sigmas(num_inference_steps: int) -> list[float]:
    """The σ points both pipelines shift into the schedule (diffusers' `get_default_z_image_sigmas`)."""
    return torch.linspace(1.0, 1 / num_inference_steps, num_inference_steps).tolist()


def schedule(scheduler, num_inference_steps: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(timesteps [T], sigmas [T+1]) of Z-Image's `FlowMatchEulerDiscreteScheduler` for this many steps, as both
    pipelines set it (mu of the image's token count, used only by a scheduler with dynamic shifting). Uses a copy,
    so the caller's scheduler keeps its state."""
    import copy

    from diffusers.pipelines.z_image.pipeline_z_image import calculate_shift

    sched = copy.deepcopy(scheduler)
    cfg = sched.config
    mu = calculate_shift(seq_len, cfg.get("base_image_seq_len", 256), cfg.get("max_image_seq_len", 4096),
                         cfg.get("base_shift", 0.5), cfg.get("max_shift", 1.15))
    sched.set_timesteps(sigmas=default_sigmas(num_inference_steps), mu=mu, device="cpu")
    return sched.timesteps.float(), sched.sigmas.float()


def latent_size(height: int, width: int) -> tuple[int, int]:
    """(h, w) of the latent: 8x smaller than the image, a multiple of the 2x2 patch."""
    return 2 * (height // (VAE_SCALE_FACTOR * 2)), 2 * (width // (VAE_SCALE_FACTOR * 2))


def image_tokens(height: int, width: int) -> int:
    h, w = latent_size(height, width)
    return (h // PATCH) * (w // PATCH)


def initial_latents(generators: Sequence[torch.Generator], num_channels: int, height: int, width: int,
                    device: torch.device | str = "cpu") -> torch.Tensor:
    """x at σ = 1, one sample per generator: [n, C, h, w] fp32. Same draws as both pipelines' `prepare_latents`."""
    from diffusers.utils.torch_utils import randn_tensor

    h, w = latent_size(height, width)
    return randn_tensor((len(generators), num_channels, h, w), generator=list(generators),
                        device=torch.device(device), dtype=torch.float32)


def velocity(transformer, latents: torch.Tensor, timestep: torch.Tensor, captions: list[torch.Tensor], *,
             dtype: torch.dtype, guidance_scale: float = 1.0,
             negative_captions: list[torch.Tensor] | None = None) -> torch.Tensor:
    """The velocity [B, C, h, w] fp32 at (latents [B, C, h, w] fp32, timestep [] on the ×1000 σ scale), one caption
    [S_i, D] per sample (and one negative caption each under CFG, guidance_scale s > 1), the transformer computing
    in `dtype`. Under CFG both branches go through one forward of 2B, as the pipelines batch them."""
    batch = latents.shape[0]
    t = (1000 - timestep.to(device=latents.device, dtype=torch.float32).expand(batch)) / 1000
    x = latents.to(dtype)
    cfg = guidance_scale > 1
    if cfg:
        x, t, captions = x.repeat(2, 1, 1, 1), t.repeat(2), list(captions) + list(negative_captions)
    out = transformer(list(x.unsqueeze(2).unbind(dim=0)), t, captions, return_dict=False)[0]  # B x [C, 1, h, w]
    if cfg:
        g = guidance_scale - 1
        pred = torch.stack([pos.float() + g * (pos.float() - neg.float())
                            for pos, neg in zip(out[:batch], out[batch:], strict=True)])
    else:
        pred = torch.stack([o.float() for o in out])
    return -pred.squeeze(2)


def group_velocity(transformer, timesteps: torch.Tensor, embeds: torch.Tensor, negative_embeds: torch.Tensor | None,
                   *, batch: int, guidance_scale: float, device, dtype) -> Velocity:
    """The velocity function of `batch` samples of one prompt group (`app.algo.sampling`): v(x, i) at the
    schedule's timestep i; the group's caption [S, D] (and negative one under CFG) is every sample's."""
    caption = embeds.to(device=device, dtype=dtype)
    negative = None
    if guidance_scale > 1:
        negative = [negative_embeds.to(device=device, dtype=dtype)] * batch

    def v(x: torch.Tensor, i: int) -> torch.Tensor:
        return velocity(transformer, x, timesteps[i].to(device), [caption] * batch, dtype=dtype,
                        guidance_scale=guidance_scale, negative_captions=negative)

    return v


def score_trajectory(transformer, traj: Trajectory, steps: Sequence[int], samples: Sequence[int] | None = None, *,
                     flow_grpo_compat: bool = False, dtype: torch.dtype | None = None) -> list[SDEStepOutput]:
    """Re-score the stored transitions x_{steps[k]} → x_{steps[k]+1} of a trajectory under `transformer`
    (`app.algo.sampling.score_steps`); differentiable when the transformer requires grad. The latents are fed in
    fp32, as the rollout kept them, and cast to the transformer's dtype inside `velocity`."""
    param = next(transformer.parameters())
    device, dtype = param.device, dtype or param.dtype
    idx = list(range(traj.group_size)) if samples is None else list(samples)
    v = group_velocity(transformer, traj.timesteps, traj.prompt_embeds, traj.negative_prompt_embeds, batch=len(idx),
                       guidance_scale=traj.guidance_scale, device=device, dtype=dtype)
    return score_steps(v, traj.latents[idx], steps, traj.sigmas, traj.step_noise_levels, sde_type=traj.sde_type,
                       flow_grpo_compat=flow_grpo_compat, device=device, dtype=torch.float32)


def decode_images(vae, latents: torch.Tensor) -> torch.Tensor:
    """Final latents [n, C, h, w] → uint8 images [n, H, W, 3] (un-normalised, VAE-decoded, rounded), as both
    pipelines decode them."""
    x = latents.to(vae.dtype) / vae.config.scaling_factor + vae.config.shift_factor
    image = vae.decode(x, return_dict=False)[0]  # [n, 3, H, W] in [-1, 1]
    image = (image / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 1).float().cpu().numpy()
    return torch.from_numpy((image * 255).round().astype("uint8"))


def shaped_trajectory(path, request: GenerationRequest, config, generator: torch.Generator) -> Trajectory:
    """A group shaped as the rollout returns it for `request`, random values (benchmarks: the cost does not depend
    on them); `config` is the transformer's. Captions of TYPICAL_PROMPT_TOKENS."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    n, steps = request.n, request.num_inference_steps
    h, w = latent_size(request.height, request.width)
    scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(path, subfolder="scheduler")
    timesteps, sigmas = schedule(scheduler, steps, image_tokens(request.height, request.width))

    def caption():
        return torch.randn(TYPICAL_PROMPT_TOKENS, config["cap_feat_dim"], generator=generator)

    mask = torch.ones(TYPICAL_PROMPT_TOKENS, dtype=torch.long)
    return Trajectory.sampled(
        request, seed=request.seed, lora_version=0, family="z_image",
        images=torch.zeros(n, request.height, request.width, 3, dtype=torch.uint8),
        latents=torch.randn(n, steps + 1, config["in_channels"], h, w, generator=generator),
        log_probs=torch.zeros(n, steps), timesteps=timesteps, sigmas=sigmas, prompt_embeds=caption(),
        prompt_mask=mask, negative_prompt_embeds=caption() if request.do_cfg else None,
        negative_prompt_mask=mask.clone() if request.do_cfg else None, conditioning={})
