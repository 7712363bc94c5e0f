"""Group advantages with numbers worked out by hand."""

import pytest
import torch

from app.algo.advantages import group_advantages


def test_one_group_is_centred_and_scaled_by_its_std():
    """rewards [1, 3]: group mean 2.0, population std 1.0 → advantages −1, +1."""
    adv, m = group_advantages(torch.tensor([1.0, 3.0]), torch.tensor([0, 0]), eps=1e-12)
    assert adv.tolist() == pytest.approx([-1.0, 1.0])
    assert m["adv/zero_std_frac"] == 0.0


def test_flat_group_gets_zero_advantage_and_is_counted():
    """groups {1, 3} and {5, 5}: the second has std 0 → advantages 0; one of two groups flat → frac 0.5."""
    adv, m = group_advantages(torch.tensor([1.0, 3.0, 5.0, 5.0]), torch.tensor([7, 7, 2, 2]), eps=1e-12)
    assert adv.tolist() == pytest.approx([-1.0, 1.0, 0.0, 0.0])
    assert m["adv/zero_std_frac"] == 0.5


def test_batch_std_mode():
    """rewards [1, 3, 5, 5] in groups {1, 3}, {5, 5}; batch mean 3.5, batch std √(11/4) = 1.658312:
    group 1 → (1 − 2)/1.658312 = −0.603023, (3 − 2)/1.658312 = +0.603023; group 2 flat → 0."""
    adv, _ = group_advantages(torch.tensor([1.0, 3.0, 5.0, 5.0]), torch.tensor([0, 0, 1, 1]), std_mode="batch",
                              eps=1e-12)
    assert adv.tolist() == pytest.approx([-0.603023, 0.603023, 0.0, 0.0], abs=1e-6)


def test_clipping():
    """rewards [0, 0, 0, 10]: mean 2.5, std √(75/4) = 4.330127 → [−0.57735 ×3, +1.732051]; clip 1 → +1."""
    rewards, groups = torch.tensor([0.0, 0.0, 0.0, 10.0]), torch.zeros(4, dtype=torch.long)
    adv, _ = group_advantages(rewards, groups, eps=1e-12, clip_max=None)
    assert adv.tolist() == pytest.approx([-0.57735, -0.57735, -0.57735, 1.732051], abs=1e-6)
    clipped, m = group_advantages(rewards, groups, eps=1e-12, clip_max=1.0)
    assert clipped.tolist() == pytest.approx([-0.57735, -0.57735, -0.57735, 1.0], abs=1e-6)
    assert m["adv/clip_frac"] == 0.25


def test_interleaved_groups_match_a_float64_loop():
    g = torch.Generator().manual_seed(0)
    rewards = torch.rand(24, generator=g, dtype=torch.float64)
    groups = torch.randint(0, 5, (24,), generator=g)
    adv, _ = group_advantages(rewards, groups, eps=1e-4, clip_max=None)
    for gid in groups.unique():
        sel = groups == gid
        r = rewards[sel]
        expected = (r - r.mean()) / (r.std(correction=0) + 1e-4) if sel.sum() > 1 else torch.zeros_like(r)
        assert torch.allclose(adv[sel].double(), expected, atol=1e-6)


def test_bad_arguments():
    with pytest.raises(ValueError, match="std_mode"):
        group_advantages(torch.zeros(2), torch.zeros(2, dtype=torch.long), std_mode="global")
    with pytest.raises(ValueError, match="group_index"):
        group_advantages(torch.zeros(2), torch.zeros(3, dtype=torch.long))


def test_step_advantages_keep_each_group_under_its_id():
    """Groups 7 and 2 (ids out of order, as workers gather them): group 7 = [1, 2, 3], mean 2, population std
    sqrt(2/3) = 0.816497 → ±1/(0.816497 + 1e-4) = ±1.224557; group 2 = [5, 5, 5] is flat → 0."""
    from app.algo.advantages import step_advantages

    adv, metrics = step_advantages({7: [1.0, 2.0, 3.0], 2: [5.0, 5.0, 5.0]})
    a = 1 / ((2 / 3) ** 0.5 + 1e-4)
    assert adv[7].tolist() == pytest.approx([-a, 0.0, a], rel=1e-6) and adv[2].tolist() == [0.0, 0.0, 0.0]
    assert metrics["adv/zero_std_frac"] == 0.5
