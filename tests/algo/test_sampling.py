"""The one sample/score loop (app/algo/sampling.py): what it samples, it scores back exactly; a sample's noise is its
own generator's, whatever the batch; the window's ODE steps carry no density."""

import pytest
import torch

from app.algo.sampling import TrajectoryRecorder, sample_trajectory, score_steps
from app.algo.sde import sde_step

SIGMAS = torch.tensor([1.0, 0.75, 0.5, 0.25, 0.0])


def velocity(x: torch.Tensor, i: int) -> torch.Tensor:
    """A stand-in denoiser: v = ε − x0 for x0 = 0.3·x, varying with the step."""
    return x * (1.0 - 0.3 * (i + 1))


def generators(seed: int, n: int) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(seed + j) for j in range(n)]


def test_scoring_what_was_sampled_gives_its_log_probs_exactly():
    x = torch.randn(3, 5, 4, generator=torch.Generator().manual_seed(0))
    levels = [0.0, 0.7, 0.7, 0.0]  # a window of two steps
    latents, log_probs = sample_trajectory(velocity, x, SIGMAS, levels, sde_type="sde", generators=generators(1, 3))
    assert latents.shape == (3, 5, 5, 4) and log_probs.shape == (3, 4)
    assert torch.equal(latents[:, 0], x) and torch.equal(log_probs[:, [0, 3]], torch.zeros(3, 2))  # ODE steps
    scored = score_steps(velocity, latents, [1, 2], SIGMAS, levels, sde_type="sde")
    assert torch.equal(torch.stack([o.log_prob for o in scored], dim=1), log_probs[:, [1, 2]])


def test_the_loop_is_the_sde_step_applied_in_order():
    """Hand-unrolled: x1 = step(v(x0, 0), x0), ..., with each sample's generator drawing its noise in turn."""
    x = torch.randn(2, 6, generator=torch.Generator().manual_seed(3))
    latents, log_probs = sample_trajectory(velocity, x, SIGMAS, [0.5] * 4, sde_type="cps", generators=generators(5, 2))
    gens, ref = generators(5, 2), x
    for i in range(4):
        out = sde_step(velocity(ref, i), ref, SIGMAS[i], SIGMAS[i + 1], noise_level=0.5, sde_type="cps",
                       sigma_max=SIGMAS[1], generator=gens, sample_dtype=ref.dtype)
        ref = out.prev_sample
        assert torch.equal(latents[:, i + 1], ref) and torch.equal(log_probs[:, i], out.log_prob)


def test_a_sample_s_noise_does_not_depend_on_its_batch():
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(2))
    whole, _ = sample_trajectory(velocity, x, SIGMAS, [0.9] * 4, sde_type="sde", generators=generators(7, 3))
    alone, _ = sample_trajectory(velocity, x[2:], SIGMAS, [0.9] * 4, sde_type="sde",
                                 generators=generators(7, 3)[2:])
    assert torch.equal(whole[2:], alone)


def test_the_recorder_refuses_a_schedule_its_noise_levels_do_not_fit():
    with pytest.raises(ValueError, match="3 noise levels for a schedule of 4 steps"):
        TrajectoryRecorder(SIGMAS, [0.7] * 3, sde_type="sde", generators=generators(0, 1))
