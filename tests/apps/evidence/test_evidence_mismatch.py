"""Synthetic mismatch distributions and the lognormal fit used to locate the seed's IS-weight state."""

import math

import numpy as np
import pytest

from nemo_is_plugin.apps.evidence.mismatch import MismatchDistribution, fit_sequence_weight, unbiased_sampler


@pytest.mark.parametrize("mean,std,length", [(0.4, 0.27, 9000), (0.9, 0.1, 512), (2.0, 3.0, 16384)])
def test_fit_inverts_the_lognormal_prediction(mean, std, length):
    dist = fit_sequence_weight(mean, std, length)
    got_mean, got_std = dist.lognormal_sequence_weight(length)
    assert got_mean == pytest.approx(mean, rel=1e-12)
    assert got_std == pytest.approx(std, rel=1e-12)


def test_seed_fit_parameters():
    """The seed's 0.4 / 0.27 at 9k tokens means a per-token std of 0.65% and a shift of -1.23e-4 nats.

    Derived here from the lognormal W = exp(S), S = sum of L i.i.d. tokens ~ N(L mu, L sigma^2) by the CLT:
    std(W) / E[W] = sqrt(exp(Var S) - 1) gives Var S = log(1 + (std / mean)^2), and E[W] = exp(E[S] + Var S / 2)
    gives E[S] = log(mean) - Var S / 2; per token, sigma = sqrt(Var S / L) and mu = E[S] / L (Python floats: float64).
    """
    mean, std, length = 0.4, 0.27, 9000
    var_s = math.log1p((std / mean) ** 2)
    mean_s = math.log(mean) - var_s / 2
    dist = fit_sequence_weight(mean, std, length)
    assert dist.spread == pytest.approx(math.sqrt(var_s / length), rel=1e-12)
    assert dist.shift == pytest.approx(mean_s / length, rel=1e-12)
    assert dist.spread == pytest.approx(0.006459, abs=1e-6)  # the docstring's 0.65%
    assert dist.shift == pytest.approx(-1.23e-4, abs=5e-7)  # and -1.23e-4 nats


def test_unbiased_sampler_shift_is_minus_half_variance():
    dist = unbiased_sampler("u", 0.02)
    assert dist.shift == pytest.approx(-2e-4)
    assert dist.lognormal_sequence_weight(9000)[0] == pytest.approx(1.0, rel=1e-12)


@pytest.mark.parametrize("df", [4.0, math.inf])
def test_samples_have_the_stated_moments(df):
    """Sums over L tokens have mean L*shift and std sqrt(L)*spread (tolerances: 4 standard errors)."""
    dist = MismatchDistribution("t", shift=-1e-3, spread=0.02, df=df)
    n, length = 4000, 256
    sums = dist.sample(n, length, np.random.default_rng(0)).sum(1).numpy()
    mean, std = dist.sequence_log_weight_moments(length)
    assert abs(sums.mean() - mean) < 4 * std / math.sqrt(n)
    # se(std) = std / sqrt(2n) for near-Gaussian sums (CLT at 256 tokens).
    assert abs(sums.std(ddof=1) - std) < 4 * std / math.sqrt(2 * n)


def test_invalid_parameters_raise():
    with pytest.raises(ValueError):
        MismatchDistribution("x", 0.0, 0.0)
    with pytest.raises(ValueError):
        MismatchDistribution("x", 0.0, 0.01, df=2.0)
    with pytest.raises(ValueError):
        fit_sequence_weight(-0.4, 0.27, 9000)
