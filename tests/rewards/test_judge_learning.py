"""The VLM judge's Yes/No score can be learnt: FlowGRPO on the tiny Qwen-Image (tests/learning.py: the engine,
policy and update pass of the job, in one process; configs/tiny_cpu.yaml's recipe, 24 steps) raises the tiny random
judge's P(Yes) / (P(Yes) + P(No)) over three seeds, well beyond what the same runs at lr 0 move.

Measured on a 2-core CPU machine with AVX-512 (gain = mean score of the last 4 steps minus the first 4; seeds 0, 1, 2):

    yesno  lr 3e-1: +0.0029 +0.0006 +0.0013   lr 5e-1: −0.0028 +0.0026 +0.0020   lr 1e-1: −0.0023 +0.0009 −0.0000
           lr 1.0:  +0.0005 −0.0004 +0.0001   lr 0:    −0.0000 +0.0001 −0.0001
    ocr    lr 3e-1: +0.0000 +0.0000 +0.0000   (lr 0 the same)

On one with AVX2 only (AMD EPYC, 2026-11-27; torch's kernels round differently there): lr 3e-1 +0.0004 −0.0002
+0.0016, one seed of three not moving. So the check is the seeds' mean gain, 4x the largest lr-0 gain, with at least
two seeds above every lr-0 gain.

The tiny judge's Yes share stays near 0.45 for every image (random weights), so the gains are small in absolute
terms, 6-29x the lr-0 ones. The `ocr` mode gives nothing to learn here: the random judge reads bytes, never the
prompt's text, so every image scores 0 (checked for its scoring and determinism in test_vlm_judge.py).
"""

import pytest
from learning import gain, reward_curve

from app.config import load
from app.rewards.judge import VlmJudgeReward

SEEDS, STEPS = (0, 1, 2), 24
LR, THRESHOLD, LR0_GAIN = 3e-1, 4e-4, 1e-4  # LR0_GAIN: the largest lr-0 gain measured


@pytest.mark.slow
def test_the_judges_yes_share_is_learnt_over_three_seeds(diffusers_engine, tiny_model_dir, tiny_judge_dir):
    config = load("configs/tiny_cpu.yaml", [f"model.path={tiny_model_dir}"])
    reward = VlmJudgeReward(str(tiny_judge_dir), mode="yesno")
    gains = [gain(reward_curve(diffusers_engine, tiny_model_dir, config, seed=seed, lr=LR, steps=STEPS,
                               reward=reward)) for seed in SEEDS]
    print(f"yesno, lr {LR}: gains", " ".join(f"{g:+.4f}" for g in gains))
    assert sum(gains) / len(gains) > THRESHOLD and sum(g > LR0_GAIN for g in gains) >= 2, gains
