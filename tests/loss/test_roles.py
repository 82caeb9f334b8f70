"""Each role of a ``Roles`` record lands in its place in the per-token terms (loss/roles.py -> terms.term_inputs), on a
hand-built float64 batch: pi_old is the ratio's denominator (NeMo-RL's prev_logprobs; mu in bypass mode; sg c under
force_on_policy_ratio), the IS correction compares ``is_prev`` with mu, the KL's weight reads the role its KLSpec names,
and a rejected token (IS weight 0) leaves the policy term, value and gradient, while the KL keeps it."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from nemo_is_plugin.loss import LossInputs
from nemo_is_plugin.loss.config_model import ClippedPGLossConfig
from nemo_is_plugin.loss.kl import KLSpec
from nemo_is_plugin.loss.layout import TokenLayout
from nemo_is_plugin.loss.roles import Roles
from nemo_is_plugin.loss.terms import loss_terms, term_inputs, token_terms

F64 = torch.float64
# two sequences of three tokens; the last token of the first is masked
C = torch.tensor([[-1.0, -0.5, -2.0], [-0.3, -1.2, -0.8]], dtype=F64)
PREV = torch.tensor([[-1.1, -0.45, -9.0], [-0.25, -1.0, -0.9]], dtype=F64)
GEN = torch.tensor([[-1.3, -0.4, -7.0], [-0.2, -1.5, -0.7]], dtype=F64)
REF = torch.tensor([[-0.9, -0.7, -3.0], [-0.5, -1.1, -0.6]], dtype=F64)
ADV = torch.tensor([[1.0, 1.0, 1.0], [-0.5, -0.5, -0.5]], dtype=F64)
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]], dtype=F64)
VALID = MASK.bool()
LAYOUT = TokenLayout.padded(2, 3)
# the token-level IS weight exp(is_prev - mu) of every token: an explicit level computes it from the difference alone
IS_KEYS = {"use_importance_sampling_correction": True, "is_correction_level": "token"}


def _inputs(prev: torch.Tensor | None = PREV) -> LossInputs:
    curr = C.clone().requires_grad_(True)
    return LossInputs(curr, prev, GEN, REF, ADV, MASK, torch.ones(2, dtype=F64), 2.0, float(MASK.sum()))


# (config keys, the tensor pi_old is, the tensor the IS correction compares with mu)
PI_OLD_CASES = {
    "prev_logprobs": ({}, PREV, PREV),
    "bypass": ({"old_policy_logprobs": "generation"}, GEN, C),
    "force_on_policy_ratio": ({"force_on_policy_ratio": True}, C, C),
}


@pytest.mark.parametrize("case", PI_OLD_CASES)
def test_pi_old_and_the_is_compare_tensor_land_in_their_places(case):
    keys, pi_old, is_prev = PI_OLD_CASES[case]
    cfg = ClippedPGLossConfig(**keys, **IS_KEYS)
    # bypass and force_on_policy_ratio never read prev_logprobs: they may be absent
    terms = loss_terms(cfg, _inputs(PREV if case == "prev_logprobs" else None), LAYOUT)
    t = terms.term_inputs
    assert torch.equal(t.pi_old, pi_old) and not t.pi_old.requires_grad
    assert torch.equal(t.mu, GEN)
    assert torch.equal(terms.is_prev, is_prev)
    log_w = t.correction.log_weights if t.correction is not None else None
    assert log_w is not None and torch.equal(log_w[VALID], (is_prev - GEN)[VALID])
    # the policy ratio divides by pi_old (the counted tokens; the masked one is anchored at ratio 1)
    assert torch.allclose(terms.surrogate.ratio[VALID], torch.exp(C - pi_old)[VALID], rtol=1e-15, atol=0)
    # the IS weights of counted tokens multiply the policy term; the masked token's weight is 0
    assert torch.equal(t.is_weight, torch.where(VALID, torch.exp(is_prev - GEN), 0.0))


def test_a_missing_prev_logprobs_is_named_when_pi_old_reads_them():
    with pytest.raises(Exception, match="prev_logprobs"):
        loss_terms(ClippedPGLossConfig(), _inputs(None), LAYOUT)


def _roles(cfg: ClippedPGLossConfig, c: torch.Tensor, **changes) -> Roles:
    return dataclasses.replace(Roles.of_loss_inputs(cfg, _inputs(), LAYOUT, c), **changes)


@pytest.mark.parametrize(
    ("weight", "reads"),
    [("score_function", None), ("generation", GEN), ("anchor", PREV), ("none", None)],
)
def test_the_kl_weight_reads_the_role_its_spec_names(weight, reads):
    """k1 = c - ref, times exp(c - sg c) (value 1, gradient 1), exp(c - mu), exp(c - pi_old) or 1."""
    cfg = ClippedPGLossConfig(reference_policy_kl_penalty=0.1, reference_policy_kl_type="k1")
    c = C.clone().requires_grad_(True)
    roles = _roles(cfg, c, kl=KLSpec("k1", weight=weight))
    t = term_inputs(cfg, roles, LAYOUT)
    assert t.reference is not None and torch.equal(t.reference, REF) and t.kl_coef == 0.1
    kl = token_terms(t, c).kl
    assert kl is not None
    w = torch.ones_like(C) if reads is None else torch.exp(C - reads)
    torch.testing.assert_close(kl.detach(), w * (C - REF), rtol=1e-15, atol=0)
    (grad,) = torch.autograd.grad(kl.sum(), c)
    # d/dc [w (c - ref)] = w + (dw/dc) (c - ref); dw/dc = w for every weight that reads c, 0 for none
    want = w + (0.0 if weight == "none" else w * (C - REF))
    torch.testing.assert_close(grad, want, rtol=1e-15, atol=0)


def test_nemo_rls_kl_is_the_plugins_keys():
    cfg = ClippedPGLossConfig(reference_policy_kl_penalty=0.2, use_on_policy_kl_approximation=True)
    roles = Roles.of_loss_inputs(cfg, _inputs(), LAYOUT, C)
    assert roles.kl == KLSpec.of(cfg) and roles.kl.weight == "generation" and roles.kl_coef == 0.2
    no_kl = ClippedPGLossConfig(reference_policy_kl_penalty=0.0)
    off = Roles.of_loss_inputs(no_kl, _inputs(), LAYOUT, C)
    assert off.reference is None and off.kl is None and term_inputs(no_kl, off, LAYOUT).kl is None


def test_a_rejected_token_leaves_the_policy_term_and_keeps_its_kl():
    """The IS correction's rejection sets the weight to 0: w_t sur_t is 0 there, value and gradient (no second
    zeroing is needed by any host), while the KL term of that token is untouched."""
    # k1 per token: gen - prev = [-0.2, 0.05, .], [0.05, -0.5, 0.2]: the rule min -0.3 rejects token (1, 1) only
    rule = {"statistic": "k1", "aggregation": "token", "min": -0.3}
    cfg = ClippedPGLossConfig(importance_sampling_rejection_rules=[rule], reference_policy_kl_penalty=0.1)
    c = C.clone().requires_grad_(True)
    t = term_inputs(cfg, Roles.of_loss_inputs(cfg, _inputs(), LAYOUT, c), LAYOUT)
    assert t.correction is not None
    rejected = t.correction.rejected & VALID
    assert rejected.tolist() == [[False, False, False], [False, True, False]]
    tokens = token_terms(t, c)
    assert tokens.actor[1, 1] == 0 and tokens.surrogate.loss[1, 1] != 0
    assert tokens.kl is not None and tokens.kl[1, 1] != 0
    (g_actor,) = torch.autograd.grad(tokens.actor.sum(), c, retain_graph=True)
    (g_kl,) = torch.autograd.grad(tokens.kl.sum(), c)
    assert g_actor[1, 1] == 0 and g_kl[1, 1] != 0
    assert (g_actor[VALID & ~rejected] != 0).all()


def test_without_a_correction_or_a_sampler_the_roles_say_so():
    """``corrects`` False: no IS correction, weight 1 (the host corrects); ``mu`` None: the batch is on-policy, the
    KL's on-policy weight reads pi_old; an IS correction without mu is refused."""
    cfg = ClippedPGLossConfig(reference_policy_kl_penalty=0.1, use_on_policy_kl_approximation=True)
    roles = _roles(cfg, C, corrects=False, mu=None)
    t = term_inputs(cfg, roles, LAYOUT)
    assert t.correction is None and t.is_weight is None
    assert torch.equal(t.mu, PREV)
    with pytest.raises(ValueError, match="mu"):
        term_inputs(cfg, dataclasses.replace(roles, corrects=True), LAYOUT)
