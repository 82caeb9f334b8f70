"""NeMo-RL behaviours beyond the first golden suite (tests/data/golden/nemo_rl_compat, produced by NeMo-RL's own
ClippedPGLossFn at commit 7ea279ab): top-k / top-p unfiltered log-probs for the KL, -inf generation log-probs,
positive log-probs, the NLL weight without rewards, force_on_policy_ratio together with disable_ppo_ratio.

Each case is checked for the loss, the gradient w.r.t. both current log-prob inputs and every metric NeMo-RL returns,
at the README's tolerances, with the default (NeMo-RL-tolerant) input checks."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from helpers.golden_utils import case_ids, finite_grad, load_cases, metric_close

from nemo_is_plugin import build_loss_fn
from nemo_is_plugin.config import ConfigValidationError

CASES = load_cases("nemo_rl_compat")
KINDS = ("unfiltered", "neg_inf_gen", "positive", "nll_no_rewards", "force_and_disable")


def _run(case, config=None):
    inputs = dict(case["inputs"])
    x = inputs.pop("next_token_logprobs").clone().requires_grad_(True)
    leaves = [x]
    if "curr_logprobs_unfiltered" in inputs:
        inputs["curr_logprobs_unfiltered"] = inputs["curr_logprobs_unfiltered"].clone().requires_grad_(True)
        leaves.append(inputs["curr_logprobs_unfiltered"])
    loss, metrics = build_loss_fn(config or case["config"])(
        next_token_logprobs=x,
        data=inputs,
        global_valid_seqs=case["global_valid_seqs"],
        global_valid_toks=case["global_valid_toks"],
    )
    grads = torch.autograd.grad(loss, leaves, allow_unused=True) if loss.requires_grad else [None] * len(leaves)
    grads = [torch.zeros_like(t) if g is None else g for t, g in zip(leaves, grads)]
    return loss, metrics, grads


def test_suite_covers_every_kind():
    kinds = [c["description"].split()[0] for c in CASES]
    assert len(CASES) == 38 and {k: kinds.count(k) for k in KINDS} == {
        "unfiltered": 10,
        "neg_inf_gen": 10,
        "positive": 10,
        "nll_no_rewards": 4,
        "force_and_disable": 4,
    }


@pytest.mark.parametrize("case", CASES, ids=case_ids(CASES))
def test_golden_case(case):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the one-time input warnings; their metrics are checked below
        loss, metrics, grads = _run(case)
    want = case["expected"]
    torch.testing.assert_close(loss.detach(), want["loss"].to(loss.dtype), rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(grads[0], finite_grad(want["grad_next_token_logprobs"]), rtol=1e-4, atol=1e-6)
    if "grad_curr_logprobs_unfiltered" in want:
        torch.testing.assert_close(grads[1], want["grad_curr_logprobs_unfiltered"], rtol=1e-4, atol=1e-6)
    bad = {
        k: (metrics.get(k), v)
        for k, v in want["metrics"].items()
        if k not in metrics or not metric_close(k, metrics[k], v)
    }
    assert not bad, f"{case['id']} {case['description']}: metric mismatches (got, want): {bad}"


UNFILTERED = [c for c in CASES if c["description"].startswith("unfiltered")]


@pytest.mark.parametrize("case", UNFILTERED, ids=case_ids(UNFILTERED))
def test_unfiltered_logprobs_carry_the_whole_kl(case):
    """The KL and its weight read curr_logprobs_unfiltered: the gradient w.r.t. the filtered log-probs is the
    KL-free loss's, and the KL's gradient lands on the unfiltered ones."""
    no_kl = dict(case["config"], reference_policy_kl_penalty=0.0)
    _, _, (g_filtered, _) = _run(case)
    _, _, (g_no_kl, g_unf_no_kl) = _run(case, no_kl)
    torch.testing.assert_close(g_filtered, g_no_kl, rtol=1e-5, atol=1e-7)
    assert torch.count_nonzero(g_unf_no_kl) == 0  # not read without the KL (NeMo-RL reads it only then)
    assert torch.count_nonzero(case["expected"]["grad_curr_logprobs_unfiltered"]) > 0


NEG_INF = [c for c in CASES if c["description"].startswith("neg_inf_gen")]


@pytest.mark.parametrize("case", NEG_INF, ids=case_ids(NEG_INF))
def test_neg_inf_generation_is_reported_and_refused_in_strict_mode(case):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loss, metrics, _ = _run(case)
    valid = case["inputs"]["token_mask"][:, 1:] * case["inputs"]["sample_mask"][:, None]
    bad = (~torch.isfinite(case["inputs"]["generation_logprobs"][:, 1:]) & (valid != 0)).sum().item()
    assert bad == 1 and torch.isfinite(loss)
    assert metrics["input_nonfinite_generation_fraction"] == pytest.approx(1 / float(case["global_valid_toks"]))
    assert all(math.isfinite(metrics[k]) for k in ("mismatch_kl_k1", "mismatch_kl_k3", "is_weight_mean"))
    with pytest.raises(ValueError, match=r"data\['generation_logprobs'\] contains NaN or inf; 1 bad element"):
        _run(case, dict(case["config"], strict_input_checks=True))


def test_rejected_config_type_is_both_assertion_and_value_error():
    case = next(c for c in CASES if c["description"].startswith("positive"))
    with pytest.raises(AssertionError) as err:
        build_loss_fn(dict(case["config"], ratio_clip_c=0.5))
    assert isinstance(err.value, (ConfigValidationError, ValueError)) and "ratio_clip_c" in str(err.value)


EXACT_SUITES = [c for suite in ("nemo_rl", "nemo_rl_compat") for c in load_cases(suite) if "error" not in c["expected"]]


def test_loss_and_nemo_rl_metrics_are_bit_exact_on_every_golden_case():
    """NeMo-RL computes in float32 with sum(v * m) / (N + 1e-8); the plugin's NeMo-RL-exact values follow the same
    order, so the loss and every NeMo-RL metric are NeMo-RL's exact float32 values (1.0, not 0.9999999967) on all
    valid cases of both suites (the same torch 2.13 CPU build produced them)."""
    differ = {}
    for case in EXACT_SUITES:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            loss, metrics, _ = _run(case)
        got = {"loss": loss.item(), **{k: metrics[k] for k in case["expected"]["metrics"]}}
        want = {"loss": case["expected"]["loss"].item(), **case["expected"]["metrics"]}
        bad = {k: (got[k], v) for k, v in want.items() if not (got[k] == v or (math.isnan(got[k]) and math.isnan(v)))}
        if bad:
            differ[f"{case['id']} {case['description'][:30]}"] = bad
    assert len(EXACT_SUITES) == 140 and not differ, differ
