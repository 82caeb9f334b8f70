"""Experiment 3 (docs/evidence.md, 3): which KL(pi_theta || pi_ref) estimators give an unbiased *gradient* as a loss.

Small categorical policy pi_theta = softmax(theta) over K actions and a fixed pi_ref. The exact gradient of KL(pi_theta
|| pi_ref) comes from autograd on the closed form sum_a pi (log pi - log pi_ref). The Monte Carlo draws x ~ pi_theta and
differentiates the plugin's per-sample penalty :func:`nemo_is_plugin.loss.kl.kl_penalty` (NeMo-RL clamps from the config
defaults) through log pi_theta(x); each draw has its own copy of theta, so one backward pass yields every per-sample
gradient.

Two families of variants:

- pathwise (``weights=None``; verl, and the seed's setting): E[grad k1] = E[grad log pi] = 0, E[grad k2] = grad KL,
  E[grad k3] = -E[(pi_ref / pi) grad log pi] = pi - pi_ref (the gradient of the *reverse* KL), and the
  straight-through option (value k3, gradient k2) is unbiased.
- score-function weight w = exp(c - sg[c]) (:func:`nemo_is_plugin.loss.kl.score_function_weight`, NeMo-RL's default):
  the gradient becomes grad E_x~pi_theta[k(x)], so estimators with an unbiased *value* (k1, k3) give the unbiased
  gradient and k2 does not; the straight-through option detaches the weight and stays unbiased.

``LOSS`` runs the same draws through the whole :class:`~nemo_is_plugin.loss.ClippedPGLoss` (KL term only), so the figure
also shows what the loss does with each configuration. :func:`expected_gradient` computes each variant's exact expected
gradient by enumerating the K actions through the same plugin code, so the Monte Carlo confirms a number that is also
known exactly.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from nemo_is_plugin.apps.evidence.stats import hotelling_test, mean_estimate
from nemo_is_plugin.loss.config_model import ClippedPGLossConfig
from nemo_is_plugin.loss.kl import kl_penalty, score_function_weight


@dataclass(frozen=True)
class CategoricalKLProblem:
    """pi_theta = softmax(logits) and pi_ref = softmax(ref_logits) over K actions. Both Float64[K]."""

    logits: torch.Tensor
    ref_logits: torch.Tensor

    @property
    def pi(self) -> torch.Tensor:
        return torch.softmax(self.logits, -1)

    @property
    def ref_logprobs(self) -> torch.Tensor:
        return torch.log_softmax(self.ref_logits, -1)

    def exact_kl(self) -> float:
        logp = torch.log_softmax(self.logits, -1)
        return float((logp.exp() * (logp - self.ref_logprobs)).sum())

    def exact_gradient(self) -> torch.Tensor:
        """grad_theta KL(pi_theta || pi_ref) by autograd on the closed form. Float64[K]."""
        theta = self.logits.clone().requires_grad_(True)
        logp = torch.log_softmax(theta, -1)
        (grad,) = torch.autograd.grad((logp.exp() * (logp - self.ref_logprobs)).sum(), theta)
        return grad


@dataclass(frozen=True)
class KLVariant:
    """One way of using an estimator as a loss: kl_type, straight-through k2 gradient, NeMo-RL's score weight.

    With ``loss_config`` set (``(key, value)`` pairs of :class:`ClippedPGLossConfig`), the gradient is instead that of
    the whole :class:`~nemo_is_plugin.loss.ClippedPGLoss` with penalty 1 and zero advantages: the KL term exactly as
    the loss applies it (the other fields then only label the variant).
    """

    name: str
    kl_type: str
    straight_through: bool = False
    score_weight: bool = False
    loss_config: tuple[tuple[str, object], ...] | None = None


PATHWISE = (
    KLVariant("k1", "k1"),
    KLVariant("k2", "k2"),
    KLVariant("k3", "k3"),
    KLVariant("k3 straight-through", "k3", straight_through=True),
)
SCORE_WEIGHTED = tuple(
    KLVariant(v.name + " + score weight", v.kl_type, v.straight_through, score_weight=True) for v in PATHWISE
)
# The loss itself: NeMo-RL's default k3, k2 (e.g. ProRLv2's recipe), and the plugin's straight-through option.
LOSS = (
    KLVariant("loss k3", "k3", False, True, (("reference_policy_kl_type", "k3"),)),
    KLVariant("loss k2", "k2", False, True, (("reference_policy_kl_type", "k2"),)),
    KLVariant(
        "loss k3, kl_gradient=k2",
        "k3",
        True,
        False,
        (("reference_policy_kl_type", "k3"), ("reference_policy_kl_gradient", "k2")),
    ),
)
ALL_VARIANTS = PATHWISE + SCORE_WEIGHTED + LOSS


def make_problem(*, num_actions: int = 6, seed: int = 0, scale: float = 1.0) -> CategoricalKLProblem:
    """Random logits for pi_theta and pi_ref, N(0, scale^2) each (KL of order scale^2)."""
    g = torch.Generator().manual_seed(seed)
    logits = scale * torch.randn(num_actions, generator=g, dtype=torch.float64)
    ref_logits = scale * torch.randn(num_actions, generator=g, dtype=torch.float64)
    return CategoricalKLProblem(logits, ref_logits)


def per_sample_penalty(
    problem: CategoricalKLProblem, actions: torch.Tensor, variant: KLVariant
) -> tuple[torch.Tensor, torch.Tensor]:
    """The plugin's KL penalty of each draw and its gradient with respect to that draw's copy of theta.

    Args:
        actions: Long[N] actions drawn from pi_theta.
    Returns:
        (values Float64[N], gradients Float64[N, K]).
    """
    cfg = ClippedPGLossConfig()  # NeMo-RL's clamps, from the only place defaults live
    theta = problem.logits.expand(actions.numel(), -1).clone().requires_grad_(True)
    logp = torch.log_softmax(theta, -1).gather(-1, actions[:, None]).squeeze(-1)
    penalty = functools.partial(
        kl_penalty,
        logp,
        problem.ref_logprobs[actions],
        kl_type=variant.kl_type,
        input_clamp=cfg.kl_input_clamp_value,
        output_clamp=cfg.kl_output_clamp_value,
    )
    if variant.loss_config is not None:
        with torch.no_grad():
            values = penalty()
        return values, _loss_gradient(problem, actions, logp, theta, dict(variant.loss_config))
    weights = score_function_weight(logp) if variant.score_weight else None
    kl = penalty(weights=weights, straight_through_k2=variant.straight_through)
    (grad,) = torch.autograd.grad(kl.sum(), theta)
    return kl.detach(), grad


def _loss_gradient(
    problem: CategoricalKLProblem, actions: torch.Tensor, logp: torch.Tensor, theta: torch.Tensor, overrides: dict
) -> torch.Tensor:
    """Per-draw gradient of ClippedPGLoss's KL term: N one-token sequences, beta = 1, advantages 0 (no actor
    gradient), prev = generation = current log-probs, global_valid_toks = 1 so the token mean is a plain sum."""
    from nemo_is_plugin.loss import ClippedPGLoss, LossInputs
    from nemo_is_plugin.loss.layout import TokenLayout

    n = actions.numel()
    c = logp[:, None]  # [N, 1]
    inputs = LossInputs(
        curr_logprobs=c,
        prev_logprobs=c.detach(),
        generation_logprobs=c.detach(),
        reference_logprobs=problem.ref_logprobs[actions][:, None],
        advantages=torch.zeros_like(c),
        token_mask=torch.ones_like(c),
        sample_mask=torch.ones(n, dtype=c.dtype, device=c.device),
        global_valid_seqs=float(n),
        global_valid_toks=1.0,
    )
    layout = TokenLayout.padded(n, 1, c.device)
    loss, _ = ClippedPGLoss({"reference_policy_kl_penalty": 1.0, **overrides}).compute(inputs, layout)
    (grad,) = torch.autograd.grad(loss, theta)
    return grad


def expected_gradient(problem: CategoricalKLProblem, variant: KLVariant) -> torch.Tensor:
    """Exact E_x~pi[grad penalty(x)]: the plugin's per-sample gradient for every action, weighted by pi. [K]."""
    actions = torch.arange(problem.logits.numel(), device=problem.logits.device)
    _, grads = per_sample_penalty(problem, actions, variant)
    return problem.pi @ grads


def analyse_variant(
    problem: CategoricalKLProblem, actions: torch.Tensor, variant: KLVariant, exact: torch.Tensor
) -> dict:
    """Monte Carlo mean of the variant's gradient against the exact KL gradient, with CIs and tests."""
    values, grads = per_sample_penalty(problem, actions, variant)
    est = mean_estimate(grads)
    lo, hi = est.ci95()
    z = est.z(exact.numpy())
    stat, dof, p_value = hotelling_test(grads, exact)
    expected = expected_gradient(problem, variant)
    value = mean_estimate(values[:, None])
    return {
        "name": variant.name,
        "kl_type": variant.kl_type,
        "straight_through": variant.straight_through,
        "score_weight": variant.score_weight,
        "loss_config": dict(variant.loss_config) if variant.loss_config else None,
        "mean": est.mean.tolist(),
        "se": est.se.tolist(),
        "ci95_low": lo.tolist(),
        "ci95_high": hi.tolist(),
        "z": z.tolist(),
        "max_abs_z": float(np.abs(z).max()),
        "hotelling_t2": stat,
        "hotelling_dof": dof,
        "p_value": p_value,
        "expected_gradient": expected.tolist(),
        "exact_bias_norm": float((expected - exact).norm()),
        "value_mean": float(value.mean[0]),
        "value_se": float(value.se[0]),
    }


def run_kl_gradient_bias(
    *,
    num_actions: int = 6,
    num_samples: int = 200_000,
    seed: int = 0,
    scale: float = 1.0,
    progress: Callable[[str], None] | None = None,
) -> dict:
    """Run every variant on the same draws. Returns a JSON-ready dict."""
    problem = make_problem(num_actions=num_actions, seed=seed, scale=scale)
    g = torch.Generator().manual_seed(seed + 1)
    actions = torch.multinomial(problem.pi, num_samples, replacement=True, generator=g)
    exact = problem.exact_gradient()
    variants = []
    for variant in ALL_VARIANTS:
        if progress:
            progress(f"KL gradient: {variant.name}")
        variants.append(analyse_variant(problem, actions, variant, exact))
    return {
        "num_actions": num_actions,
        "num_samples": num_samples,
        "pi": problem.pi.tolist(),
        "pi_ref": problem.ref_logprobs.exp().tolist(),
        "exact_kl": problem.exact_kl(),
        "exact_gradient": exact.tolist(),
        "variants": variants,
    }
