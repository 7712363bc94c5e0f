"""The tiny FLUX.1 learns: FlowGRPO with the FLUX diffusers engine, the policy's update pass and the
JPEG-compressibility reward raises the reward by more than the seed-to-seed noise, on each of three seeds.

In one process, without Ray (tests/learning.py; the loop around the same parts is tests/test_train_job_flux.py):
each step samples 4 groups of 4 with the adapter last trained (the guidance input 3.5), scores them, and takes one
update. Measured on this CPU (configs/tiny_flux_cpu.yaml's recipe: 32 steps, lr 2e-1, a LoRA of the output
projection; mean reward of the last 4 steps minus the first 4; one torch thread, as the tests run):

    learning (lr 2e-1, output projection):     seed 0: +0.299, seed 1: +0.316, seed 2: +0.092
    no learning (lr 0), the noise:             seed 0: +0.004, seed 1: +0.006, seed 2: -0.015
    lr 1e-1 / 7e-2 / 5e-2 / 3e-2:              +0.044 -0.058 +0.286 / +0.919 -0.045 +0.031 /
                                               +0.059 +0.002 -0.167 / -0.023 -0.012 -0.010
    the family's targets (flow_grpo's), lr 1e-2 / 3e-2 / 1e-1 (two threads): +0.008 +0.008 -0.009 /
                                               +0.012 -0.007 -0.016 / +0.033 -0.023 +0.051
    the single blocks' MLP input (proj_mlp), lr 1e-1 (two threads): +0.020 +0.028 +0.002

The threshold 0.06 is four times the largest noise and below every learning seed. As the tiny SD3, the tiny random
FLUX learns through its output projection, and unevenly: below lr 2e-1 some seed falls back (with two torch threads
lr 1e-1 rose on all three, +0.163 +0.147 +0.386: the runs are that sensitive to rounding). On an AVX2-only CPU
(2026-11-29) lr 2e-1 gave +0.803 +0.339 -0.077, and 48 steps showed why: seed 0 climbs to -2.82 by step 28 and falls
back to -3.45, seed 2 wanders. A recipe that holds on both kinds of CPU is still to be found. The candidate, lr 1e-1
over 48 steps, on the AVX2 CPU: +0.724 +0.560 +0.153 (at its step 32: +0.634 +0.146 +0.072); lr 2e-1 over 48 steps:
+0.230 +0.618 +0.085. It needs the AVX-512 machine's three seeds before it replaces this one.
"""

import pytest
from learning import gain, reward_curve

from app.config import load

STEPS, LR, SEEDS = 32, 2e-1, (0, 1, 2)
THRESHOLD = 0.06


@pytest.mark.slow
def test_tiny_flux_learns_jpeg_compressibility(flux_engine, tiny_flux_dir):
    config = load("configs/tiny_flux_cpu.yaml", [f"model.path={tiny_flux_dir}"])
    gains = [gain(reward_curve(flux_engine, tiny_flux_dir, config, seed=seed, lr=LR, steps=STEPS)) for seed in SEEDS]
    print(f"tiny FLUX, lr {LR}: gains", " ".join(f"{g:+.4f}" for g in gains))
    assert all(g > THRESHOLD for g in gains), gains
