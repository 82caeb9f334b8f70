"""The NeMo-RL golden suites (tests/data/golden/nemo_rl, nemo_rl_compat) through the compiled loss epilogue
(``CompiledLoss``, NeMo-RL's call): each suite's own case check (tests/test_golden_nemo_rl.py,
tests/test_golden_nemo_rl_compat.py: the loss, the gradients w.r.t. the log-probs and every metric at the READMEs'
tolerances) with the loss it builds compiled (helpers/compiled_golden.py), and the loss and NeMo-RL's metrics
NeMo-RL's exact float32 values, as the eager loss's are.

By default (``make test``): a sample of cases with the ``aot_eager`` backend and one with inductor; every other case
is the opt-in sweep (``sweep`` marker, ``make test-sweep``). Costs, docs/performance.md (*The loss epilogue
compiled*)."""

from __future__ import annotations

import math
import warnings

import pytest
import test_golden_nemo_rl as nemo_rl_suite
import test_golden_nemo_rl_compat as compat_suite
from helpers.compiled_golden import SWEEP_BACKEND, compiled_suite, sample_params

SWEEP = pytest.mark.sweep
# seq-level IS + TIS + k1 KL + dual clip; CISPO; the NLL term with rewards; a sample whose mask row is all zero
NEMO_RL_SAMPLE = {"case_009", "case_063", "case_072", "case_081"}
COMPAT_SAMPLE = {"case_000", "case_018"}  # unfiltered log-probs for the KL (ICEPOP); a -inf generation log-prob (GSPO)
INDUCTOR_SAMPLE = ["case_018"]  # GSPO, sequence-level ICEPOP, k2 KL


def assert_nemo_rl_exact(case, loss, metrics) -> None:
    """The loss and every NeMo-RL metric NeMo-RL's float32 value bit for bit (NaN equals NaN), as the eager loss's
    are on every valid case of both suites (test_golden_nemo_rl_compat.py, the bit-exact test)."""
    got = {"loss": loss.item(), **{k: metrics[k] for k in case["expected"]["metrics"]}}
    want = {"loss": case["expected"]["loss"].item(), **case["expected"]["metrics"]}
    bad = {k: (got[k], v) for k, v in want.items() if not (got[k] == v or (math.isnan(got[k]) and math.isnan(v)))}
    assert not bad, bad


@pytest.mark.parametrize("case", sample_params(nemo_rl_suite.VALID, NEMO_RL_SAMPLE, SWEEP))
def test_nemo_rl_golden_case_compiled(case, monkeypatch):
    with compiled_suite(monkeypatch, nemo_rl_suite, SWEEP_BACKEND):
        nemo_rl_suite.test_golden_case(case)


@pytest.mark.parametrize("case", sample_params(compat_suite.CASES, COMPAT_SAMPLE, SWEEP))
def test_nemo_rl_compat_golden_case_compiled(case, monkeypatch):
    with compiled_suite(monkeypatch, compat_suite, SWEEP_BACKEND):
        compat_suite.test_golden_case(case)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the one-time input warnings
            loss, metrics, _ = compat_suite._run(case)
    assert_nemo_rl_exact(case, loss, metrics)


@pytest.mark.parametrize("case", sample_params(nemo_rl_suite.VALID, NEMO_RL_SAMPLE, SWEEP))
def test_nemo_rl_bit_exact_compiled(case, monkeypatch):
    """The same check on the first suite's cases, through the compat suite's runner (it returns the metrics)."""
    with compiled_suite(monkeypatch, compat_suite, SWEEP_BACKEND):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            loss, metrics, _ = compat_suite._run(case)
    assert_nemo_rl_exact(case, loss, metrics)


@pytest.mark.parametrize("case_id", INDUCTOR_SAMPLE)
def test_nemo_rl_golden_case_inductor(case_id, monkeypatch):
    """inductor's generated kernels at the suite's tolerances (not bit for bit: its fused reductions sum in another
    order)."""
    (case,) = [c for c in nemo_rl_suite.VALID if c["id"] == case_id]
    with compiled_suite(monkeypatch, nemo_rl_suite, "inductor"):
        nemo_rl_suite.test_golden_case(case)
