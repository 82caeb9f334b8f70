"""KL estimator gradients (seed 003), through the plugin's kl_penalty with NeMo-RL's default clamps."""

import numpy as np
import pytest
import torch

from nemo_is_plugin.apps.evidence import kl_gradient_bias as kb


@pytest.fixture(scope="module")
def problem():
    return kb.make_problem(num_actions=6, seed=0)


@pytest.fixture(scope="module")
def mc(problem):
    res = kb.run_kl_gradient_bias(num_actions=6, num_samples=20_000, seed=0)
    return {v["name"]: v for v in res["variants"]}, res


def _grad_of_expected(problem, fn):
    """Exact grad_theta of E_{x~pi_theta}[fn(log pi(x), log ref(x))] by autograd on the closed form."""
    theta = problem.logits.clone().requires_grad_(True)
    logp = torch.log_softmax(theta, -1)
    (g,) = torch.autograd.grad((logp.exp() * fn(logp, problem.ref_logprobs)).sum(), theta)
    return g


def test_expected_gradients_by_enumeration_match_the_analysis(problem):
    """Exact expectations of each variant's gradient (enumeration through the plugin) vs the closed forms."""
    pi, ref = problem.pi, problem.ref_logprobs.exp()
    grad_kl = problem.exact_gradient()
    grad_e_k2 = _grad_of_expected(problem, lambda lp, lr: (lr - lp) ** 2 / 2)
    want = {
        "k1": torch.zeros_like(pi),  # E[grad log pi] = 0
        "k2": grad_kl,
        "k3": pi - ref,  # -E[(ref/pi) grad log pi]: the gradient of KL(ref || pi)
        "k3 straight-through": grad_kl,
        "k1 + score weight": grad_kl,
        "k2 + score weight": grad_e_k2,  # grad of E[k2], which is not the KL
        "k3 + score weight": grad_kl,
        "k3 straight-through + score weight": grad_kl,
    }
    for variant in kb.PATHWISE + kb.SCORE_WEIGHTED:
        torch.testing.assert_close(kb.expected_gradient(problem, variant), want[variant.name], atol=1e-12, rtol=1e-9)
    assert (grad_e_k2 - grad_kl).norm() > 0.05  # the k2 + score-weight bias is not a rounding effect


def test_k3_gradient_is_biased_k2_and_straight_through_are_not(mc):
    """Seed 003: Monte Carlo with 20k draws, Hotelling test of E[grad] = grad KL and per-component z-scores."""
    v, _ = mc
    assert v["k3"]["p_value"] < 1e-20 and v["k3"]["max_abs_z"] > 10
    assert v["k1"]["p_value"] < 1e-20
    for name in ("k2", "k3 straight-through"):
        assert v[name]["p_value"] > 1e-3
        assert v[name]["max_abs_z"] < 4.0
        assert v[name]["exact_bias_norm"] < 1e-12


def test_score_weight_makes_k1_k3_unbiased_and_k2_biased(mc):
    v, _ = mc
    for name in ("k1 + score weight", "k3 + score weight", "k3 straight-through + score weight"):
        assert v[name]["p_value"] > 1e-3 and v[name]["max_abs_z"] < 4.0
    assert v["k2 + score weight"]["p_value"] < 1e-20


def test_values_k1_k3_unbiased_k2_biased(mc):
    """The estimators' values: k1 and k3 estimate KL (within 4 se), k2 does not (its bias is > 4 se here)."""
    v, res = mc
    kl = res["exact_kl"]
    for name in ("k1", "k3"):
        assert abs(v[name]["value_mean"] - kl) < 4 * v[name]["value_se"]
    assert abs(v["k2"]["value_mean"] - kl) > 4 * v["k2"]["value_se"]


def test_ci_covers_the_exact_gradient_for_unbiased_variants(mc):
    v, res = mc
    exact = np.array(res["exact_gradient"])
    lo, hi = np.array(v["k2"]["ci95_low"]), np.array(v["k2"]["ci95_high"])
    # 6 components at 95%: allow at most 2 misses (P(>2 misses) ~ 2e-3 for independent components)
    assert np.sum((exact < lo) | (exact > hi)) <= 2
    lo, hi = np.array(v["k3"]["ci95_low"]), np.array(v["k3"]["ci95_high"])
    assert np.sum((exact < lo) | (exact > hi)) >= 4


def test_the_loss_applies_the_kl_as_analysed(problem, mc):
    """ClippedPGLoss's KL term: default k3 unbiased, k2 biased (score weight), k2 gradient option unbiased."""
    by_name = {v.name: v for v in kb.LOSS}
    grad_kl = problem.exact_gradient()
    for name, twin in (
        ("loss k3", "k3 + score weight"),
        ("loss k2", "k2 + score weight"),
        ("loss k3, kl_gradient=k2", "k3 straight-through"),
    ):
        want = kb.expected_gradient(problem, next(v for v in kb.ALL_VARIANTS if v.name == twin))
        # rtol 1e-7: the loss's token mean divides by global_valid_toks + 1e-8 (NeMo-RL's masked_mean)
        torch.testing.assert_close(kb.expected_gradient(problem, by_name[name]), want, atol=1e-12, rtol=1e-7)
    v, _ = mc
    assert v["loss k3"]["p_value"] > 1e-3 and v["loss k3, kl_gradient=k2"]["p_value"] > 1e-3
    assert v["loss k2"]["p_value"] < 1e-20
    assert (kb.expected_gradient(problem, by_name["loss k2"]) - grad_kl).norm() > 0.05
