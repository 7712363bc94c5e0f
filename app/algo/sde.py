"""One reverse step of the flow-matching SDE, with the Gaussian log-density of the step taken.

Adapted from the equations of FlowGRPO (Liu et al. 2025, "Flow-GRPO", eq. 9) and of coefficient-preserving
sampling (Wang & Yu 2025, "CPS"); written from the papers, not from their code. Every engine (vllm-omni,
diffusers) and the trainer call `sde_step`; there is no second copy of this step in the project.

Conventions (rectified flow, as in diffusers' FlowMatchEulerDiscreteScheduler):
    x_σ = (1 − σ)·x_0 + σ·ε,   the model predicts the velocity v = ε − x_0,   σ goes from 1 (noise) to 0 (data),
    dt = σ_next − σ < 0.

"sde"  (FlowGRPO): with diffusion coefficient g = η·sqrt(σ / (1 − σ))
    μ = x + dt·[v + g²/(2σ)·(x + (1 − σ)·v)]                         x_{next} ~ N(μ, s²),  s = g·sqrt(−dt)
    At σ = 1 the coefficient is infinite; as in FlowGRPO the denominator then uses `sigma_max` (the schedule's
    second sigma) instead of σ.
"cps"  (coefficient-preserving): with s = σ_next·sin(η·π/2)
    x̂_0 = x − σ·v,  ε̂ = x + (1 − σ)·v,  μ = (1 − σ_next)·x̂_0 + sqrt(σ_next² − s²)·ε̂,   x_{next} ~ N(μ, s²)
η = 0 gives the Euler ODE step x + dt·v for both types.

The log-prob is the true Gaussian log-density log N(x_next | μ, s²), averaged over the non-batch dimensions
(one number per sample). A step with s = 0 (η = 0, or "cps" at σ_next = 0) is deterministic: it has no density,
its log-prob is reported as 0 and it must not be trained on.

`flow_grpo_compat=True` reproduces flow_grpo / verl-omni scoring for "cps": −(x_next − μ)² without the 1/(2s²)
scale and the normalising constant (their clip ranges are tuned to it). It changes nothing for "sde".
Their KL also divides by `noise_scale`² (g², without the sqrt(−dt) factor) instead of s²: see `kl_std`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch

SDE_TYPES = ("sde", "cps")  # declared here only: app.config.SdeType is built from it
_HALF_LOG_2PI = 0.5 * math.log(2 * math.pi)


class SDEStepOutput(NamedTuple):
    prev_sample: torch.Tensor  # [B, ...] fp32, x at σ_next (sampled, or the one given to score)
    log_prob: torch.Tensor  # [B] fp32, mean over non-batch dims of log N(prev_sample | μ, s²)
    prev_sample_mean: torch.Tensor  # [B, ...] fp32, μ
    std_dev_t: torch.Tensor  # [B, 1, ...] fp32, s: the std of x_next given x (the transition std)
    noise_scale: torch.Tensor  # [B, 1, ...] fp32, what flow_grpo calls std_dev_t: g for "sde", s for "cps"

    def kl_std(self, flow_grpo_compat: bool = False) -> torch.Tensor:
        """The std the KL to the reference divides by: s (true KL), or flow_grpo's `noise_scale`."""
        return self.noise_scale if flow_grpo_compat else self.std_dev_t


def _per_sample(value: float | torch.Tensor, batch: int, ndim: int, device: torch.device) -> torch.Tensor:
    """A scalar or [B] schedule value as a float64 tensor broadcastable against [B, ...]."""
    t = torch.as_tensor(value, device=device).to(torch.float64)
    if t.numel() not in (1, batch):
        raise ValueError(f"schedule value has {t.numel()} elements; expected 1 or the batch size {batch}")
    return t.reshape(-1, *([1] * (ndim - 1)))  # [B or 1, 1, ...]


def _standard_normal(shape: torch.Size, generator, device: torch.device) -> torch.Tensor:
    """fp32 N(0, 1) noise; a list of generators draws sample i from generator i (reproducible per sample)."""
    if isinstance(generator, Sequence):
        if len(generator) != shape[0]:
            raise ValueError(f"got {len(generator)} generators for a batch of {shape[0]}")
        return torch.cat([_standard_normal((1, *shape[1:]), g, device) for g in generator])
    gen_device = generator.device if generator is not None else device
    return torch.randn(shape, generator=generator, dtype=torch.float32, device=gen_device).to(device)


def gaussian_log_prob(x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """mean over non-batch dims of log N(x | mean, std²), for a std that is constant within each sample.

    x, mean: [B, ...]; std: [B or 1, 1, ...] (any float dtype). Returns [B] fp32; 0 for a sample whose std is 0
    (a deterministic step has no density). The per-sample constants −log s − ½log 2π are added in float64, so
    the result keeps fp32 precision even when it is close to 0.
    """
    squared = ((x - mean) ** 2).mean(dim=tuple(range(1, x.ndim)))  # [B] fp32 (differentiable in mean)
    s = std.reshape(-1).to(torch.float64).expand(x.shape[0])  # [B]
    safe_s = torch.where(s > 0, s, torch.ones_like(s))
    lp = -squared.double() / (2 * safe_s**2) - torch.log(safe_s) - _HALF_LOG_2PI  # [B] float64
    return torch.where(s > 0, lp, torch.zeros_like(lp)).float()


def sde_step(
    model_output: torch.Tensor,
    sample: torch.Tensor,
    sigma: float | torch.Tensor,
    sigma_next: float | torch.Tensor,
    *,
    noise_level: float,
    sde_type: str = "sde",
    sigma_max: float | torch.Tensor | None = None,
    prev_sample: torch.Tensor | None = None,
    generator: torch.Generator | Sequence[torch.Generator] | None = None,
    flow_grpo_compat: bool = False,
    sample_dtype: torch.dtype | None = None,
) -> SDEStepOutput:
    """One reverse step x_σ → x_σ_next; samples it, or scores `prev_sample` when given.

    model_output: [B, ...] velocity v predicted at (sample, σ);  sample: [B, ...] x_σ.
    sigma, sigma_next: floats or [B] tensors (per-sample steps for the trainer).
    sigma_max: replaces σ in 1 − σ when σ == 1 ("sde" only); required if any σ == 1 and η > 0.
    generator: one generator, or one per sample; ignored when `prev_sample` is given.
    sample_dtype: round a sampled x_next to this dtype (the latent dtype the next step sees, e.g. bf16) before
    scoring it, so the log-prob is that of the stored sample and a trainer recompute agrees.
    Tensor math is fp32 whatever the input dtype (per-sample coefficients in float64); outputs are fp32.
    """
    if sde_type not in SDE_TYPES:
        raise ValueError(f"sde_type={sde_type!r} is not one of {SDE_TYPES}")
    if noise_level < 0:
        raise ValueError(f"noise_level={noise_level} must be >= 0")
    if model_output.shape != sample.shape:
        raise ValueError(f"model_output {tuple(model_output.shape)} and sample {tuple(sample.shape)} differ in shape")
    x = sample.float()  # [B, ...]
    v = model_output.float()  # [B, ...]
    batch, ndim, device = x.shape[0], x.ndim, x.device
    sig = _per_sample(sigma, batch, ndim, device)  # [B|1, 1, ...] float64
    sig_next = _per_sample(sigma_next, batch, ndim, device)  # [B|1, 1, ...] float64
    dt = sig_next - sig  # [B|1, 1, ...] < 0
    if bool((dt >= 0).any()):
        raise ValueError("sigma_next must be smaller than sigma (the reverse process lowers the noise level)")

    # μ = coef_x·x + coef_v·v, with per-sample coefficients computed in float64
    if sde_type == "sde":
        if noise_level == 0:
            g = torch.zeros_like(sig)  # the ODE; avoids 0·∞ at σ = 1
        else:
            at_one = sig >= 1
            if bool(at_one.any()) and sigma_max is None:
                raise ValueError("sigma == 1 needs sigma_max (the schedule's second sigma) for the 'sde' coefficient")
            denom = torch.where(at_one, _per_sample(sigma_max, batch, ndim, device), sig) if bool(at_one.any()) else sig
            g = noise_level * torch.sqrt(sig / (1 - denom))  # [B|1, 1, ...] diffusion coefficient
        coef_x = 1 + dt * g**2 / (2 * sig)  # μ = x + dt·[v + g²/(2σ)·(x + (1 − σ)·v)]
        coef_v = dt * (1 + g**2 * (1 - sig) / (2 * sig))
        std = g * torch.sqrt(-dt)
        noise_scale = g
    else:
        std = sig_next * math.sin(noise_level * math.pi / 2)  # [B|1, 1, ...]
        eps_weight = torch.sqrt(torch.clamp(sig_next**2 - std**2, min=0))
        coef_x = (1 - sig_next) + eps_weight  # μ = (1 − σ')·(x − σv) + √(σ'² − s²)·(x + (1 − σ)v)
        coef_v = -(1 - sig_next) * sig + eps_weight * (1 - sig)
        noise_scale = std
    mean = coef_x.float() * x + coef_v.float() * v  # [B, ...] fp32
    std32 = std.float()  # [B|1, 1, ...]

    if prev_sample is None:
        prev_sample = mean + std32 * _standard_normal(x.shape, generator, device)  # [B, ...]
        if sample_dtype is not None:
            prev_sample = prev_sample.to(sample_dtype)
    elif prev_sample.shape != x.shape:
        raise ValueError(f"prev_sample {tuple(prev_sample.shape)} must have the sample's shape {tuple(x.shape)}")
    prev = prev_sample.float()

    if sde_type == "cps" and flow_grpo_compat:
        log_prob = -((prev.detach() - mean) ** 2).mean(dim=tuple(range(1, ndim)))  # [B] flow_grpo's "cps" score
    else:
        log_prob = gaussian_log_prob(prev.detach(), mean, std)  # [B]

    std_b = std32.expand(batch, *std32.shape[1:])  # [B, 1, ...]
    noise_scale_b = noise_scale.float().expand(batch, *noise_scale.shape[1:])  # [B, 1, ...]
    assert log_prob.dtype == torch.float32 and mean.dtype == torch.float32
    return SDEStepOutput(prev, log_prob, mean, std_b, noise_scale_b)
