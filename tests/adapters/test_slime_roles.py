"""slime's batch and NeMo-RL's ``LossInputs`` holding the same float64 tokens give the same batch constants where the
hosts bind the roles alike (one ``Roles`` record each, one ``terms.term_inputs``), and differ exactly where slime's own
rules say (adapters/slime/roles.py): its IS correction compares its ``log_probs`` with the rollout log-probs also under
``--use-rollout-logprobs``; its ``train_rollout_logprob_abs_diff`` compares the current policy there; it corrects only
when the plugin's keys ask; its ``--use-kl-loss`` KL is weighted by its own choice."""

from __future__ import annotations

import pytest
import torch

from nemo_is_plugin.adapters.slime.entry_points import slime_term_inputs
from nemo_is_plugin.adapters.slime.layout import ResponseShard
from nemo_is_plugin.loss import LossInputs
from nemo_is_plugin.loss.config_model import ClippedPGLossConfig
from nemo_is_plugin.loss.kl import KLSpec
from nemo_is_plugin.loss.layout import TokenLayout
from nemo_is_plugin.loss.roles import Roles
from nemo_is_plugin.loss.terms import TermInputs, term_inputs

F64 = torch.float64
TOTALS, RESPONSES = [7, 6], [4, 3]  # two samples: prompts of 3 tokens, responses of 4 and 3
N = sum(RESPONSES)
GEN = torch.Generator().manual_seed(5)
C = torch.log(torch.rand(N, generator=GEN, dtype=F64) * 0.8 + 0.1)
LOG_PROBS = C + 0.1 * torch.randn(N, generator=GEN, dtype=F64)
ROLLOUT = C + 0.3 * torch.randn(N, generator=GEN, dtype=F64)
REF = C + 0.2 * torch.randn(N, generator=GEN, dtype=F64)
ADV = torch.repeat_interleave(torch.tensor([1.0, -0.7], dtype=F64), torch.tensor(RESPONSES))
MASK = torch.tensor([1, 1, 0, 1, 1, 1, 1], dtype=F64)
SHARD = ResponseShard(TOTALS, RESPONSES, None, "cpu")

AGREE = {  # plugin keys under which both hosts bind every role alike
    "token_tis_rule_kl": {
        "use_importance_sampling_correction": True,
        "truncated_importance_sampling_type": "tis",
        "truncated_importance_sampling_ratio": 1.2,
        "importance_sampling_rejection_rules": [{"statistic": "k3", "aggregation": "token", "max": 0.05}],
        "reference_policy_kl_penalty": 0.05,
    },
    "sequence_icepop_onpolicy_kl": {
        "is_correction_level": "sequence_mean",
        "use_importance_sampling_correction": True,
        "truncated_importance_sampling_type": "icepop",
        "truncated_importance_sampling_ratio": 1.1,
        "truncated_importance_sampling_ratio_min": 0.9,
        "reference_policy_kl_penalty": 0.1,
        "use_on_policy_kl_approximation": True,
    },
    "cumulative_veto": {
        "is_correction_level": "cumulative",
        "use_importance_sampling_correction": True,
        "importance_sampling_veto_threshold": 0.75,
        "reference_policy_kl_penalty": 0.0,
    },
}


def _split(x: torch.Tensor) -> list[torch.Tensor]:
    return list(torch.split(x, RESPONSES))


def _slime(cfg: ClippedPGLossConfig, kl=None, *, log_probs: bool = True) -> tuple[TermInputs, Roles]:
    batch = {
        "total_lengths": TOTALS,
        "response_lengths": RESPONSES,
        "loss_masks": _split(MASK),
        "advantages": _split(ADV),
        "rollout_log_probs": _split(ROLLOUT),
        "ref_log_probs": _split(REF),
        "log_probs": _split(LOG_PROBS) if log_probs else [],
    }
    return slime_term_inputs(cfg, kl, batch, SHARD, C.clone().requires_grad_(True))


def _nemo_rl(cfg: ClippedPGLossConfig) -> tuple[TermInputs, Roles]:
    inputs = LossInputs(C, LOG_PROBS, ROLLOUT, REF, ADV, MASK, torch.ones(2, dtype=F64), 2.0, float(MASK.sum()))
    layout = TokenLayout.packed([0, RESPONSES[0], N])
    roles = Roles.of_loss_inputs(cfg, inputs, layout, C)
    return term_inputs(cfg, roles, layout), roles


def _assert_same(a: TermInputs, b: TermInputs) -> None:
    for name in ("pi_old", "mu", "advantages", "token_mask", "valid", "positions", "is_weight", "reference"):
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None), name
        assert x is None or torch.equal(x, y), name
    assert a.kl == b.kl and a.kl_coef == b.kl_coef
    assert a.correction is not None and b.correction is not None
    for name in ("weights", "log_weights", "rejected"):
        assert torch.equal(getattr(a.correction, name), getattr(b.correction, name)), name


@pytest.mark.parametrize("case", AGREE)
def test_slimes_and_nemo_rls_roles_give_the_same_constants(case):
    cfg = ClippedPGLossConfig(**AGREE[case])
    (slime_t, slime_roles), (nemo_t, _) = _slime(cfg), _nemo_rl(cfg)
    _assert_same(slime_t, nemo_t)
    assert slime_t.is_weight is not None and not torch.equal(slime_t.is_weight, MASK)  # the correction bites
    assert torch.equal(slime_t.pi_old, LOG_PROBS) and torch.equal(slime_roles.mismatch_prev, LOG_PROBS)


# pi_old of both hosts (one rule), and what slime's train_rollout_logprob_abs_diff compares with mu
PI_OLD_NOT_PREV = {
    "bypass": ({"old_policy_logprobs": "generation"}, ROLLOUT, C),
    "force_on_policy_ratio": ({"force_on_policy_ratio": True}, C, LOG_PROBS),
}


@pytest.mark.parametrize("case", PI_OLD_NOT_PREV)
def test_slimes_is_correction_reads_its_log_probs_whatever_pi_old_is(case):
    """``--use-rollout-logprobs`` or ``force_on_policy_ratio``: pi_old is the same in both hosts; slime's TIS compares
    its ``log_probs`` with mu, NeMo-RL's (and verl's) the current policy; slime's abs-diff metric compares the
    current policy under ``--use-rollout-logprobs``, its ``log_probs`` otherwise (slime's policy_loss_function)."""
    keys, pi_old, mismatch = PI_OLD_NOT_PREV[case]
    cfg = ClippedPGLossConfig(**keys, use_importance_sampling_correction=True)
    (slime_t, slime_roles), (nemo_t, nemo_roles) = _slime(cfg), _nemo_rl(cfg)
    assert torch.equal(slime_t.pi_old, pi_old) and torch.equal(nemo_t.pi_old, pi_old)
    assert torch.equal(slime_roles.is_prev, LOG_PROBS) and torch.equal(nemo_roles.is_prev, C)
    assert slime_t.correction is not None and nemo_t.correction is not None
    valid = MASK.bool()
    assert torch.equal(slime_t.correction.log_weights[valid], (LOG_PROBS - ROLLOUT)[valid])
    assert torch.equal(nemo_t.correction.log_weights[valid], (C - ROLLOUT)[valid])
    assert torch.equal(slime_roles.mismatch_prev, mismatch)
    # without slime's log_probs, its IS compares the current policy too: the hosts agree again
    no_log_probs, _ = _slime(cfg, log_probs=False)
    _assert_same(no_log_probs, nemo_t)


def test_slime_corrects_only_when_the_plugins_keys_ask():
    cfg = ClippedPGLossConfig(reference_policy_kl_penalty=0.0)
    (slime_t, slime_roles), (nemo_t, _) = _slime(cfg), _nemo_rl(cfg)
    assert not slime_roles.corrects and slime_t.correction is None and slime_t.is_weight is None
    assert nemo_t.correction is not None and torch.equal(nemo_t.is_weight, MASK)  # NeMo-RL: weight 1, for its metrics
    assert torch.equal(slime_t.pi_old, nemo_t.pi_old) and torch.equal(slime_t.mu, nemo_t.mu)
    # on-policy training without log_probs: pi_old is the current policy, detached
    on_policy, _ = _slime(cfg, log_probs=False)
    assert torch.equal(on_policy.pi_old, C) and not on_policy.pi_old.requires_grad


@pytest.mark.parametrize(("unbiased", "weight"), [(True, "anchor"), (False, "none")])
def test_slimes_kl_loss_is_its_estimator_weighted_by_pi_old(unbiased, weight):
    """``--use-kl-loss --kl-loss-type low_var_kl``: k3 clamped to +-10, weighted by exp(c - pi_old) with
    ``--use-unbiased-kl``; pi_old is mu under ``--use-rollout-logprobs`` and the current policy, detached, under
    ``force_on_policy_ratio`` (the plugin's one rule for pi_old: the weight's value is 1, its gradient grad c)."""
    kl = {"coef": 0.3, "kl_type": "k3", "output_clamp": 10.0, "unbiased": unbiased}
    for keys, pi_old in (
        ({}, LOG_PROBS),
        ({"old_policy_logprobs": "generation"}, ROLLOUT),
        ({"force_on_policy_ratio": True}, C),
    ):
        t, _ = _slime(ClippedPGLossConfig(reference_policy_kl_penalty=0.0, **keys), kl)
        assert t.kl == KLSpec("k3", output_clamp=10.0, weight=weight) and t.kl_coef == 0.3
        assert t.reference is not None and torch.equal(t.reference, REF)
        assert t.kl.tokens(C, t.reference, t.mu, t.pi_old).tolist() == pytest.approx(
            ((torch.exp(C - pi_old) if unbiased else 1.0) * (torch.exp(REF - C) - 1 - (REF - C))).tolist(), rel=1e-14
        )
