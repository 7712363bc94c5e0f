"""The sample/score loop around `sde_step`: every engine samples a trajectory with it and the trainer re-scores
stored transitions with it, so a step is taken and scored by one piece of code whatever the family or engine.

A family supplies only a velocity function `velocity(x, i) -> v` (x [B, ...] at schedule point i, v like x: its
transformer, conditioning and CFG); the loop supplies the schedule, the per-step noise levels (the SDE window),
the per-sample generators and the recording. Engines whose denoising loop belongs to a library (vllm-omni's
pipelines) call `TrajectoryRecorder.step` from inside that loop instead of `sample_trajectory`.

Pure torch: numbers and tensors in, tensors out.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from app.algo.sde import SDEStepOutput, sde_step

Velocity = Callable[[torch.Tensor, int], torch.Tensor]  # (x [B, ...] at point i, i) -> v [B, ...]


class TrajectoryRecorder:
    """Takes and records the steps of one trajectory: x at every σ visited and the log-prob of every step taken.

    sigmas: [T+1] (sigmas[0] = 1, sigmas[T] = 0); noise_levels: η of each of the T steps (0 outside an SDE window:
    the ODE step); generators: one per sample, drawing that sample's noise (batching never changes it)."""

    def __init__(self, sigmas: torch.Tensor, noise_levels: Sequence[float], *, sde_type: str,
                 generators: Sequence[torch.Generator]):
        if len(noise_levels) != sigmas.shape[0] - 1:
            raise ValueError(f"{len(noise_levels)} noise levels for a schedule of {sigmas.shape[0] - 1} steps")
        self.sigmas, self.noise_levels = sigmas, list(noise_levels)
        self.sde_type, self.generators = sde_type, list(generators)
        self.latents: list[torch.Tensor] = []  # T+1 x [B, ...] fp32: x as the model saw it
        self.log_probs: list[torch.Tensor] = []  # T x [B] fp32

    @property
    def steps_taken(self) -> int:
        return len(self.log_probs)

    def step(self, v: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The next step x_σ → x_σ' from the velocity v at x (both [B, ...]): x' in x's dtype, rounded to it
        before it is scored, so the log-prob is that of the sample the next step sees."""
        i = self.steps_taken
        if i == 0:
            self.latents.append(x.detach().float().clone())  # a copy: the caller may reuse x
        out = sde_step(v, x, self.sigmas[i], self.sigmas[i + 1], noise_level=self.noise_levels[i],
                       sde_type=self.sde_type, sigma_max=self.sigmas[1], generator=self.generators,
                       sample_dtype=x.dtype)
        prev = out.prev_sample.to(x.dtype)
        self.latents.append(prev.detach().float())
        self.log_probs.append(out.log_prob.detach())
        return prev

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(latents [B, T+1, ...] fp32, log_probs [B, T] fp32) of the steps taken."""
        return torch.stack(self.latents, dim=1), torch.stack(self.log_probs, dim=1).float()


def sample_trajectory(velocity: Velocity, x: torch.Tensor, sigmas: torch.Tensor, noise_levels: Sequence[float], *,
                      sde_type: str, generators: Sequence[torch.Generator]) -> tuple[torch.Tensor, torch.Tensor]:
    """Denoise x [B, ...] (at σ = sigmas[0]) with the FlowGRPO SDE: (latents [B, T+1, ...], log_probs [B, T])."""
    recorder = TrajectoryRecorder(sigmas, noise_levels, sde_type=sde_type, generators=generators)
    for i in range(sigmas.shape[0] - 1):
        x = recorder.step(velocity(x, i), x)
    return recorder.result()


def score_steps(velocity: Velocity, latents: torch.Tensor, steps: Sequence[int], sigmas: torch.Tensor,
                noise_levels: Sequence[float], *, sde_type: str, flow_grpo_compat: bool = False,
                device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> list[SDEStepOutput]:
    """Re-score stored transitions latents[:, i] → latents[:, i + 1] for each i of `steps` (latents [B, T+1, ...]
    of some members of a group): x is fed to `velocity` in `dtype` on `device`, as the rollout fed it. One
    `SDEStepOutput` per step, differentiable through `velocity` (unless under no_grad)."""
    outputs = []
    for i in steps:
        if not 0 <= i < sigmas.shape[0] - 1:
            raise ValueError(f"step {i} is outside the trajectory's {sigmas.shape[0] - 1} steps")
        x = latents[:, i].to(device=device, dtype=dtype)
        outputs.append(sde_step(velocity(x, i), x, sigmas[i].item(), sigmas[i + 1].item(),
                                noise_level=noise_levels[i], sde_type=sde_type, sigma_max=sigmas[1].item(),
                                prev_sample=latents[:, i + 1].to(device), flow_grpo_compat=flow_grpo_compat))
    return outputs
