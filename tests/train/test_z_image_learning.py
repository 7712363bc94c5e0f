"""The tiny Z-Image learns: FlowGRPO with the Z-Image diffusers engine, the policy's update pass and the
JPEG-compressibility reward raises the reward by more than the seed-to-seed noise, on each of three seeds.

In one process, without Ray (tests/learning.py; the loop around the same parts is tests/test_train_job_z_image.py):
each step samples 4 groups of 4 with the adapter last trained, scores them, and takes one update. Measured on this
CPU (configs/tiny_z_image_cpu.yaml's recipe: 32 steps, lr 1e-1, a LoRA of the final projection; mean reward of the
last 4 steps minus the first 4; one torch thread, as the tests run):

    learning (lr 1e-1, final projection):      seed 0: +0.350, seed 1: +0.305, seed 2: +0.256
    no learning (lr 0), the noise:             seed 0: -0.010, seed 1: +0.010, seed 2: +0.002
    lr 2e-1, final projection:                 +0.332 +0.114 +0.328
    the family's targets (attention, MLP), lr 3e-2 / 1e-1: +0.007 +0.030 -0.021 / +0.025 +0.034 +0.008

The threshold 0.05 is five times the largest noise and below every learning seed. As the tiny SD3 and FLUX, the
tiny random Z-Image learns through its output projection.
"""

import pytest
from learning import gain, reward_curve

from app.config import load

STEPS, LR, SEEDS = 32, 1e-1, (0, 1, 2)
THRESHOLD = 0.05


@pytest.mark.slow
def test_tiny_z_image_learns_jpeg_compressibility(z_image_engine, tiny_z_image_dir):
    config = load("configs/tiny_z_image_cpu.yaml", [f"model.path={tiny_z_image_dir}"])
    gains = [gain(reward_curve(z_image_engine, tiny_z_image_dir, config, seed=seed, lr=LR, steps=STEPS))
             for seed in SEEDS]
    print(f"tiny Z-Image, lr {LR}: gains", " ".join(f"{g:+.4f}" for g in gains))
    assert all(g > THRESHOLD for g in gains), gains
