"""The synthetic batches hold the edge inputs the hosts' trainers pass, and the comparison's verdicts on hand-made
outcomes: tolerances, non-finite values, refusals, missing metrics."""

from __future__ import annotations

import math

import pytest
import torch

from nemo_is_plugin.apps.compat.batches import SYNTHETIC_KINDS, synthetic_batches
from nemo_is_plugin.apps.compat.compare import (
    AGREES,
    DELIBERATE,
    DIFFERS,
    PLUGIN_ONLY,
    Refusal,
    Run,
    Tolerances,
    compare_outcomes,
)


@pytest.fixture(scope="module")
def batches():
    return synthetic_batches(4)


def test_every_kind_holds_its_edge(batches):
    assert [b.name for b in batches] == [f"synthetic {i} ({k})" for i, k in enumerate(SYNTHETIC_KINDS)]
    for b in batches:
        assert b.logprobs.dtype == torch.float32 and b.logprobs.shape == (8, 39)
        assert all(v.shape[0] == 8 for v in b.data.values())
        lengths = b.data["token_mask"].sum(-1)
        assert len(set(lengths.tolist())) > 2  # several lengths
    plain, padded, minus_inf, positive = batches
    assert (padded.data["sample_mask"] == 0).sum() == 2 and (padded.data["token_mask"][-2:] == 0).all()
    assert padded.data["token_mask"][0].sum() == 1  # a one-token response
    gen = minus_inf.data["generation_logprobs"][:, 1:]
    assert int(torch.isneginf(gen).sum()) == 1 and bool(torch.isneginf(gen[minus_inf.valid]).any())
    for key in ("prev_logprobs", "generation_logprobs"):
        assert bool((positive.data[key][:, 1:][positive.valid] > 0).any())
        assert bool((plain.data[key][:, 1:][plain.valid] <= 0).all())
    # a realistic mismatch: from nearly on-policy rows to rows whose raw token IS weights pass 2
    log_w = (plain.data["prev_logprobs"] - plain.data["generation_logprobs"])[:, 1:][plain.valid]
    assert float(log_w.abs().min()) < 1e-3 and float(log_w.exp().max()) > 2.0


def test_batches_are_reproducible_and_refuse_zero():
    a, b = synthetic_batches(2, seed=5), synthetic_batches(2, seed=5)
    assert all(torch.equal(x.logprobs, y.logprobs) for x, y in zip(a, b))
    with pytest.raises(ValueError, match="at least 1 batch"):
        synthetic_batches(0)


class _Host:
    name, host_keys, plugin_keys = "host", {}, {}

    def __init__(self, note=None):
        self.note = note

    def deliberate(self, kind, name, batch):
        return self.note if kind == "nan_gradient" else None


def _run(loss=1.0, grad=(0.5, -0.25), **metrics) -> Run:
    return Run(loss, torch.tensor(grad, dtype=torch.float64), {k: float(v) for k, v in metrics.items()})


def _status(findings):
    return {f.output: f.status for f in findings}


def test_tolerances_decide(batches):
    tol = Tolerances()
    host = _run(1.0, m=2.0)
    within = _run(1.0 + 0.5e-5, m=2.0 * (1 + 0.5e-5))
    beyond = _run(1.0 * 1.001, (0.5, -0.25 * 1.001), m=2.0 * 1.001, extra=1.0)
    assert _status(compare_outcomes(_Host(), batches[0], host, within, tol)) == {
        "loss": AGREES,
        "gradient": AGREES,
        "metric m": AGREES,
    }
    found = {f.output: f for f in compare_outcomes(_Host(), batches[0], host, beyond, tol)}
    assert {k: f.status for k, f in found.items()} == {
        "loss": DIFFERS,
        "gradient": DIFFERS,
        "metric m": DIFFERS,
        "metric extra": PLUGIN_ONLY,
    }
    assert found["loss"].rel_diff == pytest.approx(1e-3)
    assert found["gradient"].abs_diff == pytest.approx(0.25e-3)


def test_non_finite_values_agree_only_when_equal(batches):
    tol = Tolerances()
    host = _run(math.inf, (math.nan, 1.0), m=math.nan)
    assert set(_status(compare_outcomes(_Host(), batches[0], host, host, tol)).values()) == {AGREES}
    other = _run(-math.inf, (0.0, 1.0), m=1.0)
    assert _status(compare_outcomes(_Host(), batches[0], host, other, tol)) == {
        "loss": DIFFERS,
        "gradient": DIFFERS,
        "metric m": DIFFERS,
    }
    # a host NaN gradient the host documents: deliberate, and the finite entries must still agree
    found = compare_outcomes(_Host("documented reason"), batches[0], host, other, tol)
    assert _status(found)["gradient"] == DELIBERATE and found[1].notes == ["documented reason"]
    off = _run(-math.inf, (0.0, 1.1))
    assert _status(compare_outcomes(_Host("documented reason"), batches[0], host, off, tol))["gradient"] == DIFFERS


def test_refusals_and_missing_metrics(batches):
    tol = Tolerances()
    both = compare_outcomes(_Host(), batches[0], Refusal("AssertionError: no"), Refusal("ValueError: no"), tol)
    assert _status(both) == {"refusal": AGREES}
    one = compare_outcomes(_Host(), batches[0], _run(), Refusal("ValueError: bad input"), tol)
    assert _status(one) == {"refusal": DIFFERS} and "only the plugin refuses" in one[0].notes[0]
    missing = compare_outcomes(_Host(), batches[0], _run(m=1.0), _run(), tol)
    assert _status(missing)["metric m"] == DIFFERS and missing[-1].notes == ["not reported by the plugin"]
