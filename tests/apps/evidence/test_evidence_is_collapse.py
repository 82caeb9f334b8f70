"""IS-weight collapse (seed 002), computed with the plugin's is_log_weight / finite_exp."""

import math

import numpy as np
import pytest
import torch

from nemo_is_plugin.apps.evidence import is_collapse as ic
from nemo_is_plugin.apps.evidence.mismatch import MismatchDistribution, unbiased_sampler
from nemo_is_plugin.apps.evidence.stats import weight_summary


def test_level_weights_match_their_formulas():
    x = torch.tensor([[0.1, -0.2, 0.05], [0.0, 0.3, -0.1]], dtype=torch.float64)
    expected = {
        "token": x.exp(),
        "sequence": x.sum(1, keepdim=True).exp().expand_as(x),
        "sequence_mean": x.mean(1, keepdim=True).exp().expand_as(x),
        "cumulative": x.cumsum(1).exp(),
    }
    for level, want in expected.items():
        w, log_w = ic.level_weights(x, level)
        torch.testing.assert_close(w, want, rtol=1e-7, atol=0)  # sequence_mean divides by L + 1e-8
        torch.testing.assert_close(log_w.exp(), w)


@pytest.mark.parametrize(
    "dist",
    [unbiased_sampler("unbiased 2%", 0.02), MismatchDistribution("2% shift", -0.02, 0.02)],
    ids=["spread-2pct", "shift-2pct"],
)
def test_exp_sum_collapses_at_9k_while_geometric_mean_stays_near_one(dist):
    """At 9k tokens a 2% mismatch sends exp(sum) far from 1; exp(mean) stays within a few percent of 1."""
    x = dist.sample(64, 9000, np.random.default_rng(1))
    seq = ic.level_weights(x, "sequence")[0][:, 0]
    geo = ic.level_weights(x, "sequence_mean")[0][:, 0]
    # log w ~ N(9000 shift, 1.9^2): P(|log w| < 0.5) is 0.13 for the spread, ~0 for the shift; 64 draws.
    far = (seq.log().abs() > 0.5).double().mean().item()
    assert far > 0.7
    assert seq.median().item() < 0.5
    assert (geo - 1).abs().max().item() < 0.03


def test_seed_state_is_reproduced_by_the_fitted_distribution():
    """The fitted mismatch gives exp(sum) mean 0.4 and std 0.27 at 9k tokens, within 4 Monte Carlo standard errors."""
    fit = ic.default_distributions()[0]
    check = ic.seed_check(fit, 512, np.random.default_rng(2))
    assert abs(check["mean"] - ic.SEED_MEAN) < 4 * check["mean_se"]
    assert abs(check["std"] - ic.SEED_STD) < 4 * check["std_se"]
    assert check["mean_se"] < 0.02  # the check has power: 4 se < 0.08
    # TIS at 2 barely changes it: P(w > 2) is ~0.1% at this spread.
    assert abs(check["tis_mean"] - check["mean"]) < 0.01


def test_run_structure_and_token_level_is_length_free():
    dist = unbiased_sampler("unbiased 1%", 0.01, df=math.inf)  # Gaussian: finite kurtosis, so se(std) is known
    res = ic.run_is_collapse(num_seqs=32, lengths=(64, 1024), distributions=[dist], seed=3)
    assert res["lengths"] == [64, 1024] and res["seed_check"] is None
    tok = res["stats"]["unbiased 1%"]["token"]
    seq = res["stats"]["unbiased 1%"]["sequence"]
    # token weight exp(x_t), lognormal: mean exactly 1 (shift = -spread^2/2), std ~ 0.01 at every length.
    # >= 2048 tokens: se(mean) <= 2.2e-4 and se(std)/std <= 1.6%; tolerances are ~4.5-5 se.
    for mean, std in zip(tok["mean"], tok["std"]):
        assert mean == pytest.approx(1.0, abs=1e-3)
        assert std == pytest.approx(0.01, rel=0.08)
    # exp(sum) spreads out with length: the log-weight std is 0.08 at 64 tokens and 0.32 at 1024
    assert seq["std"][1] > 2 * seq["std"][0]
    assert all(math.isfinite(v) for s in res["stats"]["unbiased 1%"].values() for vals in s.values() for v in vals)


def test_weight_summary_values():
    s = weight_summary(torch.tensor([1.0, 1.0, 1.0, 5.0]))
    assert s["mean"] == pytest.approx(2.0)
    assert s["std"] == pytest.approx(math.sqrt(3.0))
    assert s["ess_fraction"] == pytest.approx(4.0**2 / (4 * 7.0))
    assert s["p50"] == pytest.approx(1.0)
