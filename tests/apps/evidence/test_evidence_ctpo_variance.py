"""CTPO Props. 1-2 on a synthetic independent-token policy, via the plugin's cumulative ratio and sequence IS weight."""

import numpy as np
import pytest
import torch

from nemo_is_plugin.apps.evidence import ctpo_variance as cv
from nemo_is_plugin.loss.is_weights import is_log_weight
from nemo_is_plugin.loss.layout import TokenLayout


@pytest.fixture(scope="module")
def policy():
    return cv.make_policy(num_actions=8, chi2=0.05, horizon=16, seed=0)


@pytest.fixture(scope="module")
def result(policy):
    return cv.analyse(policy, 40_000, seed=1)


def test_policy_has_the_requested_chi2_and_exact_gradient(policy):
    assert policy.chi2 == pytest.approx(0.05, abs=1e-9)
    pi, a = policy.pi, policy.advantage
    # d/dtheta E_pi[A] = pi * (A - E_pi[A]) for a softmax
    torch.testing.assert_close(policy.exact_gradient(), pi * (a - (pi * a).sum()))


def test_estimators_match_closed_forms(policy):
    g = torch.Generator().manual_seed(5)
    actions = torch.multinomial(policy.behaviour, 6 * policy.horizon, replacement=True, generator=g).view(6, -1)
    x, y, cum_w = cv.estimator_gradients(policy, actions)
    r = policy.ratio[actions]
    f = policy.per_action_term()[actions]  # [N, H, K]
    torch.testing.assert_close(cum_w, r.cumprod(1))
    torch.testing.assert_close(x, r.cumprod(1)[..., None] * f)
    torch.testing.assert_close(y, r.prod(1)[:, None, None] * f)
    # the plugin's cumulative policy ratio has the value of its cumulative IS weight on the same log-probs
    logp = torch.log_softmax(policy.logits, -1)[actions]
    layout = TokenLayout.padded(*actions.shape)
    w = is_log_weight("cumulative", logp, policy.behaviour.log()[actions], torch.ones_like(logp), layout).exp()
    torch.testing.assert_close(w, cum_w)


def test_cumulative_estimator_is_unbiased(result):
    """Every component at every position: MC mean within 4.5 standard errors of the exact gradient (128 tests)."""
    assert result["max_abs_z_cumulative"] < 4.5
    assert result["max_abs_z_full"] < 4.5


def test_variance_ratio_matches_prop2(result):
    """E|Y_t|^2 / E|X_t|^2 = (1+d)^(H-t) within 4 standard errors at every t; variances ordered as predicted."""
    z = np.array(result["second_moment_ratio_z"])
    assert np.abs(z).max() < 4.0
    pred = np.array(result["predicted_second_moment_ratio"])
    meas = np.array(result["measured_second_moment_ratio"])
    se = np.array(result["measured_second_moment_ratio_se"])
    assert pred[0] == pytest.approx(1.05**15)
    # the effect is real: at t = 1 the ratio 2.08 is many standard errors above 1 (exact and empirical errors)
    assert (meas[0] - 1) / se[0] > 5
    assert (meas[0] - 1) / result["predicted_second_moment_ratio_se"][0] > 5
    # variance ratio vs its exact value (incl. the squared mean, 3% of the second moment here), same relative se
    meas_v, pred_v = np.array(result["measured_variance_ratio"]), np.array(result["predicted_variance_ratio"])
    assert np.all(np.abs(meas_v - pred_v) <= 4 * se / meas * meas_v + 1e-12)
    var_c, var_f = np.array(result["variance_cumulative"]), np.array(result["variance_full"])
    assert np.all(var_c[:-1] < var_f[:-1])
    assert var_c[-1] == pytest.approx(var_f[-1], rel=1e-9)  # t = H: the same product


def test_standard_errors_are_calibrated(policy):
    """Over 8 seeds the t = 1 ratio z-scores have sd near 1 (in [0.4, 1.8], a ~99% band at 7 dof), and the
    empirical standard error agrees with the exact unconditional one on average (within a factor 1.5)."""
    runs = [cv.analyse(policy, 8_000, seed=s) for s in range(8)]
    zs = [r["second_moment_ratio_z"][0] for r in runs]
    assert 0.4 < np.std(zs, ddof=1) < 1.8
    assert abs(np.mean(zs)) < 4 / np.sqrt(8)
    emp = np.mean([r["measured_second_moment_ratio_se"][0] for r in runs])
    assert 1 / 1.5 < emp / runs[0]["predicted_second_moment_ratio_se"][0] < 1.5
