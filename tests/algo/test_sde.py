"""The SDE step against float64 references written independently in this file."""

import math

import pytest
import torch

from app.algo.sde import sde_step


def reference_sde_mean_std(x, v, sigma, sigma_next, eta, sigma_max):
    """FlowGRPO eq. 9 in float64, written out from the paper: μ = x + dt·[v + g²/(2σ)(x + (1−σ)v)], s = g·√(−dt)."""
    x, v = x.double(), v.double()
    dt = sigma_next - sigma
    denom = sigma_max if sigma == 1 else sigma
    g = eta * math.sqrt(sigma / (1 - denom))
    return x + dt * (v + g * g / (2 * sigma) * (x + (1 - sigma) * v)), g * math.sqrt(-dt)


def reference_cps_mean_std(x, v, sigma, sigma_next, eta):
    """CPS in float64: s = σ'·sin(ηπ/2), μ = (1−σ')(x − σv) + √(σ'² − s²)(x + (1−σ)v)."""
    x, v = x.double(), v.double()
    s = sigma_next * math.sin(eta * math.pi / 2)
    return (1 - sigma_next) * (x - sigma * v) + math.sqrt(sigma_next**2 - s**2) * (x + (1 - sigma) * v), s


def reference_log_prob(x, mean, std):
    """float64 Gaussian log-density via torch.distributions, averaged over non-batch dims."""
    lp = torch.distributions.Normal(mean.double(), torch.full_like(mean.double(), std)).log_prob(x.double())
    return lp.mean(dim=tuple(range(1, lp.ndim)))


CASES = [("sde", 1.0, 0.8), ("sde", 0.7, 0.45), ("sde", 0.3, 0.1),
         ("cps", 1.0, 0.8), ("cps", 0.6, 0.3), ("cps", 0.2, 0.05)]


@pytest.mark.parametrize("sde_type,sigma,sigma_next", CASES)
@pytest.mark.parametrize("eta", [0.3, 0.7, 1.0])
def test_log_prob_matches_float64_gaussian(sde_type, sigma, sigma_next, eta):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 16, 64, generator=g)
    v = torch.randn(3, 16, 64, generator=g)
    out = sde_step(v, x, sigma, sigma_next, noise_level=eta, sde_type=sde_type, sigma_max=0.8,
                   generator=torch.Generator().manual_seed(1))
    if sde_type == "sde":
        mean, std = reference_sde_mean_std(x, v, sigma, sigma_next, eta, sigma_max=0.8)
    else:
        mean, std = reference_cps_mean_std(x, v, sigma, sigma_next, eta)
    ref = reference_log_prob(out.prev_sample, mean, std)
    rel = ((out.log_prob.double() - ref).abs() / ref.abs()).max().item()
    assert rel < 1e-6, rel
    assert torch.allclose(out.prev_sample_mean.double(), mean, atol=1e-5)
    assert torch.allclose(out.std_dev_t.double(), torch.full((3, 1, 1), std, dtype=torch.float64))
    assert out.log_prob.shape == (3,) and out.log_prob.dtype == torch.float32


@pytest.mark.parametrize("sde_type", ["sde", "cps"])
def test_samples_have_the_stated_mean_and_std(sde_type):
    """Over 200k draws the per-element empirical mean/std match prev_sample_mean / std_dev_t (5 standard errors)."""
    n = 200_000
    x = torch.linspace(-1, 1, 4).expand(n, 4).contiguous()
    v = torch.linspace(0.5, -0.5, 4).expand(n, 4).contiguous()
    out = sde_step(v, x, 0.6, 0.4, noise_level=0.8, sde_type=sde_type, generator=torch.Generator().manual_seed(0))
    s = out.std_dev_t[0, 0].item()
    emp_mean, emp_std = out.prev_sample.double().mean(0), out.prev_sample.double().std(0)
    assert (emp_mean - out.prev_sample_mean[0].double()).abs().max() < 5 * s / math.sqrt(n)
    assert (emp_std - s).abs().max() < 5 * s / math.sqrt(2 * n)


@pytest.mark.parametrize("sde_type", ["sde", "cps"])
def test_scoring_a_given_sample_equals_sampling_it(sde_type):
    g = torch.Generator().manual_seed(3)
    x, v = torch.randn(4, 8, 16, generator=g), torch.randn(4, 8, 16, generator=g)
    sampled = sde_step(v, x, 0.9, 0.7, noise_level=0.7, sde_type=sde_type, generator=torch.Generator().manual_seed(5))
    scored = sde_step(v, x, 0.9, 0.7, noise_level=0.7, sde_type=sde_type, prev_sample=sampled.prev_sample)
    assert torch.equal(scored.log_prob, sampled.log_prob)
    assert torch.equal(scored.prev_sample_mean, sampled.prev_sample_mean)


def test_cps_closed_form_by_hand():
    """x = 1, v = 0.5, σ = 0.6, σ' = 0.4, η = 0.5:
    s = 0.4·sin(π/4) = 0.282843;  x̂0 = 1 − 0.6·0.5 = 0.7;  ε̂ = 1 + 0.4·0.5 = 1.2;
    μ = 0.6·0.7 + √(0.16 − 0.08)·1.2 = 0.42 + 0.339411 = 0.759411.
    Scoring x' = μ + s (one std away): log N = −1/2 − ln(0.282843) − ½ln(2π) = −0.5 + 1.262864 − 0.918939 = −0.156075.
    """
    one = torch.ones(1, 1)
    out = sde_step(0.5 * one, one, 0.6, 0.4, noise_level=0.5, sde_type="cps", prev_sample=one * (0.759411 + 0.282843))
    assert out.std_dev_t.item() == pytest.approx(0.282843, abs=1e-6)
    assert out.prev_sample_mean.item() == pytest.approx(0.759411, abs=1e-6)
    assert out.log_prob.item() == pytest.approx(-0.156075, abs=1e-5)


def test_sde_closed_form_by_hand():
    """x = 1, v = 0.5, σ = 0.5, σ' = 0.25, η = 1:  g = √(0.5/0.5) = 1, dt = −0.25,
    μ = 1 − 0.25·(0.5 + 1/(2·0.5)·(1 + 0.5·0.5)) = 1 − 0.25·1.75 = 0.5625;  s = 1·√0.25 = 0.5; noise_scale g = 1."""
    one = torch.ones(1, 1)
    out = sde_step(0.5 * one, one, 0.5, 0.25, noise_level=1.0, sde_type="sde", prev_sample=one * 0.5625)
    assert out.prev_sample_mean.item() == pytest.approx(0.5625, abs=1e-7)
    assert out.std_dev_t.item() == pytest.approx(0.5, abs=1e-7)
    assert out.noise_scale.item() == pytest.approx(1.0, abs=1e-7)
    assert out.log_prob.item() == pytest.approx(-math.log(0.5) - 0.5 * math.log(2 * math.pi), abs=1e-6)


@pytest.mark.parametrize("sde_type", ["sde", "cps"])
@pytest.mark.parametrize("sigma", [1.0, 0.5])
def test_zero_noise_is_the_euler_ode_step(sde_type, sigma):
    g = torch.Generator().manual_seed(0)
    x, v = torch.randn(2, 5, 3, generator=g), torch.randn(2, 5, 3, generator=g)
    out = sde_step(v, x, sigma, sigma - 0.25, noise_level=0.0, sde_type=sde_type)
    assert torch.allclose(out.prev_sample, x - 0.25 * v, atol=1e-6)
    assert torch.all(out.std_dev_t == 0)
    assert torch.all(out.log_prob == 0)  # deterministic step: no density, reported as 0


def test_flow_grpo_compat_cps_score_is_unscaled_squared_error():
    g = torch.Generator().manual_seed(0)
    x, v = torch.randn(2, 6, generator=g), torch.randn(2, 6, generator=g)
    true = sde_step(v, x, 0.8, 0.6, noise_level=0.7, sde_type="cps", generator=torch.Generator().manual_seed(1))
    compat = sde_step(v, x, 0.8, 0.6, noise_level=0.7, sde_type="cps", prev_sample=true.prev_sample,
                      flow_grpo_compat=True)
    expected = -((true.prev_sample.double() - true.prev_sample_mean.double()) ** 2).mean(1)
    assert torch.allclose(compat.log_prob.double(), expected, atol=1e-6)
    assert not torch.allclose(compat.log_prob, true.log_prob)
    # "sde" is already a true Gaussian in flow_grpo: the option leaves it alone
    a = sde_step(v, x, 0.8, 0.6, noise_level=0.7, prev_sample=true.prev_sample)
    b = sde_step(v, x, 0.8, 0.6, noise_level=0.7, prev_sample=true.prev_sample, flow_grpo_compat=True)
    assert torch.equal(a.log_prob, b.log_prob)
    assert torch.allclose(a.kl_std(True) * math.sqrt(0.2), a.kl_std(False))


def test_generators_make_sampling_reproducible_per_sample():
    x, v = torch.zeros(3, 4), torch.zeros(3, 4)

    def gens():
        return [torch.Generator().manual_seed(s) for s in (10, 11, 12)]

    a = sde_step(v, x, 0.7, 0.5, noise_level=0.7, generator=gens()).prev_sample
    b = sde_step(v, x, 0.7, 0.5, noise_level=0.7, generator=gens()).prev_sample
    assert torch.equal(a, b)
    assert not torch.equal(a[0], a[1])
    single = sde_step(v[:1], x[:1], 0.7, 0.5, noise_level=0.7, generator=[torch.Generator().manual_seed(11)])
    assert torch.equal(single.prev_sample[0], a[1])  # sample i depends only on generator i


def test_per_sample_sigmas_match_separate_calls():
    g = torch.Generator().manual_seed(0)
    x, v = torch.randn(2, 4, 8, generator=g), torch.randn(2, 4, 8, generator=g)
    prev = torch.randn(2, 4, 8, generator=g)
    both = sde_step(v, x, torch.tensor([0.9, 0.5]), torch.tensor([0.7, 0.3]), noise_level=0.6, prev_sample=prev)
    for i, (s, sn) in enumerate([(0.9, 0.7), (0.5, 0.3)]):
        one = sde_step(v[i:i + 1], x[i:i + 1], s, sn, noise_level=0.6, prev_sample=prev[i:i + 1])
        assert torch.allclose(both.log_prob[i], one.log_prob[0])


def test_log_prob_is_differentiable_in_the_model_output():
    g = torch.Generator().manual_seed(0)
    x, prev = torch.randn(2, 8, generator=g), torch.randn(2, 8, generator=g)
    v = torch.randn(2, 8, generator=g, dtype=torch.float64).requires_grad_()
    out = sde_step(v, x, 0.8, 0.6, noise_level=0.7, prev_sample=prev)
    out.log_prob.sum().backward()
    # d/dv of mean_j −(prev − μ)²/(2s²) with μ = a·x + b·v  →  b·(prev − μ)/(s²·D)
    dt, g2 = -0.2, 0.49 * 0.8 / 0.2
    b = dt * (1 + g2 * 0.2 / (2 * 0.8))
    s2 = g2 * 0.2
    expected = b * (prev.double() - out.prev_sample_mean.double()) / (s2 * 8)
    assert torch.allclose(v.grad, expected, atol=1e-5)


@pytest.mark.parametrize("kwargs,match", [
    (dict(sde_type="ddim"), "sde_type"),
    (dict(noise_level=-0.1), "noise_level"),
    (dict(sigma=1.0), "sigma_max"),
    (dict(sigma=0.5, sigma_next=0.6), "sigma_next"),
])
def test_bad_arguments_name_the_problem(kwargs, match):
    args = dict(sigma=0.8, sigma_next=0.6, noise_level=0.7, sde_type="sde") | kwargs
    with pytest.raises(ValueError, match=match):
        sde_step(torch.zeros(1, 2), torch.zeros(1, 2), args.pop("sigma"), args.pop("sigma_next"), **args)


def test_sample_dtype_scores_the_rounded_sample():
    """A bf16 rollout stores x_next rounded to bf16; its log-prob must be that of the rounded value."""
    g = torch.Generator().manual_seed(0)
    x, v = torch.randn(2, 8, 16, generator=g), torch.randn(2, 8, 16, generator=g)
    out = sde_step(v, x, 0.8, 0.6, noise_level=0.7, generator=torch.Generator().manual_seed(1),
                   sample_dtype=torch.bfloat16)
    assert torch.equal(out.prev_sample, out.prev_sample.bfloat16().float())  # fp32 holding bf16 values
    rescored = sde_step(v, x, 0.8, 0.6, noise_level=0.7, prev_sample=out.prev_sample)
    assert torch.equal(out.log_prob, rescored.log_prob)
