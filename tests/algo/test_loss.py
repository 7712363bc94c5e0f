"""The clipped FlowGRPO surrogate and the transition KL, with numbers worked out by hand."""

import math

import pytest
import torch

from app.algo.loss import flow_grpo_loss, transition_kl


def test_ratio_one_gives_minus_mean_advantage():
    """log_prob == old_log_prob → ratio 1 → loss = −mean(adv) = −(1 − 2)/2 = 0.5; nothing clipped."""
    lp = torch.tensor([-1.3, 0.2], requires_grad=True)
    loss, m = flow_grpo_loss(lp, lp.detach().clone(), torch.tensor([1.0, -2.0]), clip_range=0.2)
    assert loss.item() == pytest.approx(0.5)
    assert m["actor/clipfrac"] == 0.0 and m["actor/ratio_mean"] == pytest.approx(1.0)
    loss.backward()
    assert lp.grad.tolist() == pytest.approx([-0.5, 1.0])  # d/dlp of −adv·ratio/2 at ratio 1


def test_clipping_by_hand():
    """ratio 1.5, clip 0.2.
    adv = +1: max(−1.5, −1.2) = −1.2 (clipped, no gradient);  adv = −1: max(1.5, 1.2) = 1.5 (unclipped).
    loss = (−1.2 + 1.5)/2 = 0.15; both ratios are outside [0.8, 1.2] → clipfrac 1."""
    lp = torch.full((2,), math.log(1.5), requires_grad=True)
    loss, m = flow_grpo_loss(lp, torch.zeros(2), torch.tensor([1.0, -1.0]), clip_range=0.2)
    assert loss.item() == pytest.approx(0.15)
    assert m["actor/clipfrac"] == 1.0
    assert m["actor/approx_kl"] == pytest.approx(0.5 * math.log(1.5) ** 2)
    loss.backward()
    assert lp.grad.tolist() == pytest.approx([0.0, 0.75])  # second: d/dlp (1.5·e^{Δ})/2 = 0.75


def test_per_step_log_probs_share_the_sample_advantage():
    """[B=2, T=2] log-probs, ratio 1 everywhere, adv [2, −1] → loss = −(2 + 2 − 1 − 1)/4 = −0.5."""
    lp = torch.zeros(2, 2)
    loss, _ = flow_grpo_loss(lp, lp, torch.tensor([2.0, -1.0]), clip_range=0.1)
    assert loss.item() == pytest.approx(-0.5)


def test_kl_by_hand_and_added_with_beta():
    """means differ by 0.1 everywhere, s = 0.5 → KL = 0.01/(2·0.25) = 0.02; β = 0.5 adds 0.01 to the loss."""
    mean = torch.full((2, 3, 4), 0.1)
    kl = transition_kl(mean, torch.zeros(2, 3, 4), torch.full((2, 1, 1), 0.5))
    assert kl.tolist() == pytest.approx([0.02, 0.02])
    lp = torch.zeros(2)
    loss, m = flow_grpo_loss(lp, lp, torch.tensor([1.0, -1.0]), clip_range=0.2, kl=kl, kl_beta=0.5)
    assert loss.item() == pytest.approx(0.01)
    assert m["actor/kl"] == pytest.approx(0.02)


def test_kl_equals_float64_kl_of_two_gaussians():
    g = torch.Generator().manual_seed(0)
    mean, ref = torch.randn(3, 10, generator=g), torch.randn(3, 10, generator=g)
    std = torch.tensor([0.3, 0.5, 0.9]).view(3, 1)
    p = torch.distributions.Normal(mean.double(), std.double().expand(3, 10))
    q = torch.distributions.Normal(ref.double(), std.double().expand(3, 10))
    expected = torch.distributions.kl_divergence(p, q).mean(1)
    assert torch.allclose(transition_kl(mean, ref, std).double(), expected, rtol=1e-6)


def test_loss_matches_a_float64_reference_on_random_inputs():
    g = torch.Generator().manual_seed(1)
    lp, old = torch.randn(8, 3, generator=g) * 0.1, torch.randn(8, 3, generator=g) * 0.1
    adv = torch.randn(8, generator=g)
    loss, _ = flow_grpo_loss(lp, old, adv, clip_range=0.05)
    ratio = (lp.double() - old.double()).exp()
    a = adv.double()[:, None]
    expected = torch.maximum(-a * ratio, -a * ratio.clamp(0.95, 1.05)).mean()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)


def test_shape_errors_are_explicit():
    with pytest.raises(ValueError, match="advantages"):
        flow_grpo_loss(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(3), clip_range=0.1)
    with pytest.raises(ValueError, match="std > 0"):
        transition_kl(torch.zeros(1, 2), torch.zeros(1, 2), torch.zeros(1, 1))


def test_behaviour_weight_by_hand():
    """Decoupled: ratio against the proximal policy (old = lp → ratio 1), each term weighed by
    w = min(exp(old − behaviour), C). behaviour = old − log 1.5 → w = 1.5; behaviour = old − log 3 → w = 3,
    truncated to C = 2. adv [1, 1] → loss = −(1.5 + 2)/2 = −1.75; the gradient is −w/2 per term."""
    lp = torch.tensor([-0.4, 0.3], requires_grad=True)
    old = lp.detach().clone()
    behaviour = old - torch.tensor([math.log(1.5), math.log(3.0)])
    loss, m = flow_grpo_loss(lp, old, torch.tensor([1.0, 1.0]), clip_range=0.1, behaviour_log_prob=behaviour,
                             behaviour_weight_max=2.0)
    assert loss.item() == pytest.approx(-1.75)
    assert m["actor/ratio_dev_max"] == 0.0  # exactly: the ratio's denominator is the forward's own log-prob
    assert m["actor/behaviour_weight_max"] == pytest.approx(2.0)
    assert m["actor/behaviour_weight_truncated"] == 0.5
    assert m["actor/behaviour_ratio_dev_max"] == pytest.approx(2.0)  # |3 − 1|, before truncation
    loss.backward()
    assert lp.grad.tolist() == pytest.approx([-0.75, -1.0])


def test_behaviour_weighted_loss_matches_a_float64_reference():
    g = torch.Generator().manual_seed(2)
    lp, old = torch.randn(8, 3, generator=g) * 0.1, torch.randn(8, 3, generator=g) * 0.1
    behaviour = old + torch.randn(8, 3, generator=g)
    adv = torch.randn(8, generator=g)
    loss, _ = flow_grpo_loss(lp, old, adv, clip_range=0.05, behaviour_log_prob=behaviour, behaviour_weight_max=1.5)
    ratio = (lp.double() - old.double()).exp()
    w = (old.double() - behaviour.double()).exp().clamp(max=1.5)
    a = adv.double()[:, None]
    expected = (w * torch.maximum(-a * ratio, -a * ratio.clamp(0.95, 1.05))).mean()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    # a behaviour equal to old weighs every term by 1: the plain loss
    plain, _ = flow_grpo_loss(lp, old, adv, clip_range=0.05)
    same, _ = flow_grpo_loss(lp, old, adv, clip_range=0.05, behaviour_log_prob=old.clone())
    assert torch.equal(plain, same)
