"""The CTPO and verl rollout-correction golden suites through the compiled loss epilogue (``CompiledLoss.compute``):
each suite's own case checks with the loss it builds compiled (helpers/compiled_golden.py).

CTPO (tests/test_golden_ctpo.py): pg_loss and its gradient at the README's rtol (1e-5, 1e-4 for T = 2048), every
clip / ratio metric with a counterpart, the rollout IS weights as given, and the power-0 cases against the float64
formulas. verl (tests/test_golden_verl.py): the weights and mask the loss applies (its gradient at ratio 1), verl's
``rollout_corr/`` metrics from the loss's metrics and the raw IS-weight metrics. The verl suite's other tests check the
mapping and the IS correction itself, not the loss: they are not repeated here.

By default (``make test``): a sample with the ``aot_eager`` backend and one CTPO case with inductor; every other case,
and a verl case with inductor, is the opt-in sweep (``sweep`` marker, ``make test-sweep``)."""

from __future__ import annotations

import pytest
import test_golden_ctpo as ctpo_suite
import test_golden_verl as verl_suite
from helpers.compiled_golden import SWEEP_BACKEND, compiled_suite, sample_params

SWEEP = pytest.mark.sweep
# CTPO-LA geomean with IS weights, seq-mean-token-mean; ratio-space CTPO geomean, seq-mean-token-sum
CTPO_SAMPLE = {"case_020", "case_028"}
# RS token_k1; the decoupled_k3_rs_token_tis preset (token TIS + a seq_mean_k3 rule)
VERL_SAMPLE = {"case_008", "case_028"}
CTPO_INDUCTOR = "case_032"  # T = 2048, CTPO-LA geomean p = -0.5: long float32 prefix sums
VERL_INDUCTOR = "case_036"  # sequence IS beyond the +20 clamp with a sequence rule


def check_ctpo(case: dict) -> None:
    ctpo_suite.test_loss_and_gradient(case)
    ctpo_suite.test_metrics(case)
    if case["params"]["uses_rollout_is_weights"]:
        ctpo_suite.test_rollout_is_weights_are_applied_as_given(case)


def check_verl(case: dict) -> None:
    verl_suite.test_weights_and_mask(case)
    verl_suite.test_rollout_corr_metrics(case)
    if case["params"]["rollout_is"] is not None:
        verl_suite.test_raw_is_weight_metrics(case)


@pytest.mark.parametrize("case", sample_params(ctpo_suite.VALID, CTPO_SAMPLE, SWEEP))
def test_ctpo_golden_case_compiled(case, monkeypatch):
    with compiled_suite(monkeypatch, ctpo_suite, SWEEP_BACKEND):
        check_ctpo(case)


@pytest.mark.sweep
@pytest.mark.parametrize("case", ctpo_suite.ERRORS, ids=[c["id"] for c in ctpo_suite.ERRORS])
def test_ctpo_power_zero_compiled(case, monkeypatch):
    """The cases the reference crashed on: the float64 formulas, and p = 0 equal to p = 1e-30 bit for bit."""
    with compiled_suite(monkeypatch, ctpo_suite, SWEEP_BACKEND):
        ctpo_suite.test_power_zero_reference_crash_is_handled(case)


@pytest.mark.parametrize("case", sample_params(verl_suite.VALID, VERL_SAMPLE, SWEEP))
def test_verl_golden_case_compiled(case, monkeypatch):
    with compiled_suite(monkeypatch, verl_suite, SWEEP_BACKEND):
        check_verl(case)


# inductor compiles take 30-240 s each here: the verl one is in the sweep
@pytest.mark.parametrize("suite, case_id", [("ctpo", CTPO_INDUCTOR), pytest.param("verl", VERL_INDUCTOR, marks=SWEEP)])
def test_golden_case_inductor(suite, case_id, monkeypatch):
    module, check = (ctpo_suite, check_ctpo) if suite == "ctpo" else (verl_suite, check_verl)
    with compiled_suite(monkeypatch, module, "inductor"):
        check(module.BY_ID[case_id])
