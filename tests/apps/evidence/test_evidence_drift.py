"""The drift experiment (score centering on / off under emulated fp8 and int4 engines), run tiny end to end: the
recorded gap is mean |log p_train - log q| recomputed in float64 from the recorded batch, q is the engine's own
log-prob, the head its top-k, the pairs share everything but the term, and the headline / figure come from the runs."""

import json

import pytest
import torch

from nemo_is_plugin.apps.evidence import drift
from nemo_is_plugin.apps.evidence.runner import run_evidence


def record_first_steps(base, precision, sc, steps=3, batch=8, seed=0):
    seen = []

    def on_step(step, policy, rollout):
        w = [p.detach().double().clone() for p in (policy.w1, policy.w2, policy.w3)]
        seen.append((step, w, rollout))

    run = drift.run_condition(base, precision, sc, steps=steps, batch=batch, seed=seed, on_step=on_step)
    return run, seen


def float64_trainer_logprobs(w, tokens):
    w1, w2, w3 = w
    prev = tokens[:, :-1]
    pos = torch.arange(prev.shape[1]).expand_as(prev)
    x = torch.cat(
        [torch.nn.functional.one_hot(prev, drift.VOCAB), torch.nn.functional.one_hot(pos, drift.LENGTH)], -1
    ).double()
    silu = torch.nn.functional.silu
    logits = silu(silu(x @ w1.t()) @ w2.t()) @ w3.t()
    return torch.log_softmax(logits, -1).gather(-1, tokens[:, 1:, None])[..., 0]


@pytest.mark.parametrize("precision", drift.PRECISIONS)
def test_gap_is_the_float64_mean_abs_log_ratio_of_the_recorded_batch(precision):
    run, seen = record_first_steps("plain", precision, True)
    assert len(run.gap) == 3 and len(seen) == 3
    for step, w, rollout in seen:
        ref = (float64_trainer_logprobs(w, rollout.tokens) - rollout.q.double()).abs().mean()
        assert run.gap[step] == pytest.approx(float(ref), rel=1e-4, abs=1e-7)
        assert run.gap[step] > 1e-3  # the emulated engine is not the trainer
    # q is the engine's own log-prob of the sampled token, the head its top-k by rank: the engine's log-softmax,
    # recomputed from the recorded weights' quantised copy one position per call (fp8's activation scale is per call)
    _, w, rollout = seen[0]
    policy = drift.TinyPolicy(seed=0)
    with torch.no_grad():
        for p, v in zip((policy.w1, policy.w2, policy.w3), w):
            p.copy_(v.float())
    eng = drift.Engine(policy, precision)
    b = rollout.tokens.shape[0]
    logits = [eng.logits(rollout.tokens[:, t], torch.full((b,), t)) for t in range(drift.LENGTH)]
    lp = torch.log_softmax(torch.stack(logits, 1).double(), -1)
    torch.testing.assert_close(
        lp.gather(-1, rollout.tokens[:, 1:, None])[..., 0], rollout.q.double(), rtol=1e-6, atol=1e-6
    )
    top, _ = lp.topk(drift.TOP_K, -1)
    torch.testing.assert_close(rollout.logprobs.double(), top, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(lp.gather(-1, rollout.ids), top, rtol=1e-6, atol=1e-6)


def test_int4_is_the_stronger_mismatch_and_the_pairs_differ_only_by_the_term():
    fp8, _ = record_first_steps("plain", "fp8", False, steps=4)
    int4, _ = record_first_steps("plain", "int4", False, steps=4)
    assert int4.gap[0] > 1.5 * fp8.gap[0]
    on, _ = record_first_steps("plain", "int4", True, steps=4)
    assert on.gap[0] == int4.gap[0] and on.reward[0] == int4.reward[0]  # same weights, same first rollout
    assert on.gap[1:] != int4.gap[1:]  # the term changed the update
    assert all(d > 0 for d in on.metrics["score_centering_drift"]) and int4.metrics == {}


def test_evidence_drift_quick_writes_the_figure_and_headline_from_the_runs(tmp_path):
    res = run_evidence(tmp_path, quick=True, only=["drift"])
    assert (tmp_path / "evidence_drift.png").stat().st_size > 10_000
    saved = json.loads((tmp_path / "evidence_numbers.json").read_text())
    d = saved["drift"]
    assert len(d["conditions"]) == 2 * len(drift.PRECISIONS) * 2
    head = saved["headline"]["drift"]["plain/int4"]
    by = {(c["base"], c["precision"], c["score_centering"]): c for c in d["conditions"]}
    a, b = drift._windows(d["steps"])[2]
    on, off = by[("plain", "int4", True)], by[("plain", "int4", False)]
    diffs = [sum(r1["gap"][a:b]) / (b - a) - sum(r0["gap"][a:b]) / (b - a) for r1, r0 in zip(on["runs"], off["runs"])]
    assert head["gap_late_diff"] == pytest.approx(sum(diffs) / len(diffs), rel=1e-9, abs=1e-12)
    assert head["gap_late_off"] == pytest.approx(sum(off["gap_mean"][a:b]) / (b - a), rel=1e-9)
    assert res["headline"] == saved["headline"]
