"""The model-based rewards can be learnt: FlowGRPO on the tiny Qwen-Image (tests/learning.py: the engine, policy and
update pass of the job, in one process; configs/tiny_cpu.yaml's recipe, 24 steps) raises the tiny random CLIP's
PickScore and aesthetic score on each of three seeds, far beyond what the same runs at lr 0 move.

Measured on a 2-core CPU machine with AVX-512 (gain = mean score of the last 4 steps minus the first 4; seeds 0, 1, 2):

    pickscore  lr 3e-1: +0.0811 +0.0781 +0.1028   lr 1e-1: +0.1019 −0.0021 −0.0152   lr 0: −0.0026 −0.0019 +0.0009
    aesthetic  lr 1e-1: +0.0020 +0.0043 +0.0022   lr 3e-1: −0.0002 +0.0021 +0.0016   lr 0: −0.0000 +0.0001 −0.0000
    clipscore  lr 1e-1: +0.0607 −0.0064 −0.0025   lr 3e-1: −0.0049 −0.0006 −0.0013   lr 3e-2: +0.0028 −0.0003 +0.0073

On one with AVX2 only (AMD EPYC, 2026-11-27; torch's kernels round differently there, and 24 steps of RL carry it
far): pickscore lr 3e-1 +0.0242 +0.0444 +0.0401. The thresholds hold on both, 6x and 20x the lr-0 gains.

The tiny aesthetic head's scores span little (its gains are small in absolute terms, 20x the lr-0 ones). CLIPScore
does not learn on this random CLIP: 2.5 · max(cos, 0) is 0 for most of its images (cos of random embeddings
scatters around 0), so most groups carry no ranking; it is checked for its formula and range only.
"""

import pytest
from learning import gain, reward_curve

from app.config import load
from app.rewards.clip import ClipReward

SEEDS, STEPS = (0, 1, 2), 24
CASES = {"pickscore": (3e-1, 0.015), "aesthetic": (1e-1, 0.001)}  # term: (lr, threshold: well above the lr-0 gains)


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(CASES))
def test_a_clip_reward_is_learnt_on_every_seed(kind, diffusers_engine, tiny_model_dir, tiny_clip_dir):
    lr, threshold = CASES[kind]
    config = load("configs/tiny_cpu.yaml", [f"model.path={tiny_model_dir}"])
    reward = ClipReward(kind, str(tiny_clip_dir), head_path=str(tiny_clip_dir / "aesthetic_head.pth"))
    gains = [gain(reward_curve(diffusers_engine, tiny_model_dir, config, seed=seed, lr=lr, steps=STEPS,
                               reward=reward)) for seed in SEEDS]
    print(f"{kind}, lr {lr}: gains", " ".join(f"{g:+.4f}" for g in gains))
    assert all(g > threshold for g in gains), gains
