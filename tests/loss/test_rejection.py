"""Rejection rules (k1 / k2 / k3 per token or as a sequence sum / mean / max), hand-computed in float64, on padded and
packed layouts; the shorthands importance_sampling_rejection / seq-mis / geo-rs as k1 rules."""

import math

import pytest
import torch

from nemo_is_plugin.config import RejectionRule
from nemo_is_plugin.loss.config_model import ClippedPGLossConfig
from nemo_is_plugin.loss.correction import compute_is_correction
from nemo_is_plugin.loss.layout import TokenLayout
from nemo_is_plugin.loss.rejection import evaluate_rule, evaluate_rules, token_statistic

F64 = torch.float64
# y = p - g per token; seq 1's third token is masked (its 50 must not count), seq 2 has no tokens.
Y = torch.tensor([[0.1, -0.2, 0.3], [-0.5, 0.05, 50.0], [1.0, 1.0, 1.0]], dtype=F64)
PREV = torch.full((3, 3), -1.0, dtype=F64)
GEN = PREV - Y
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [0.0, 0.0, 0.0]], dtype=F64)
LAY = TokenLayout.padded(3, 3)


def k(stat, y):
    y = float(y)
    return {"k1": -y, "k2": y * y / 2, "k3": math.exp(y) - 1 - y}[stat]


def expected_seq(stat, agg):
    out = []
    for row, m in zip(Y.tolist(), MASK.tolist()):
        vals = [k(stat, y) for y, keep in zip(row, m) if keep]
        if agg == "sequence_sum":
            out.append(sum(vals))
        elif agg == "sequence_mean":
            out.append(sum(vals) / (len(vals) + 1e-8))
        else:
            out.append(max(vals) if vals else 0.0)
    return torch.tensor(out, dtype=F64)


@pytest.mark.parametrize("stat", ["k1", "k2", "k3"])
def test_token_statistics(stat):
    want = torch.tensor([[k(stat, y) for y in row] for row in Y.tolist()], dtype=F64)
    torch.testing.assert_close(token_statistic(stat, Y), want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("stat", ["k1", "k2", "k3"])
@pytest.mark.parametrize("agg", ["sequence_sum", "sequence_mean", "sequence_max"])
def test_sequence_statistics_and_bounds(stat, agg):
    seq = expected_seq(stat, agg)
    bound = float(seq[:2].mean())  # between the two sequences with tokens
    rule = (
        RejectionRule(statistic=stat, aggregation=agg, max=bound, log_ratio_clamp=None)
        if stat != "k1"
        else RejectionRule(statistic=stat, aggregation=agg, min=-10.0, max=bound, log_ratio_clamp=None)
    )
    out = evaluate_rule(rule, PREV, GEN, MASK, LAY)
    torch.testing.assert_close(out.seq_stat, seq, rtol=1e-12, atol=1e-12)
    assert out.keep.tolist() == [[bool(s <= bound)] * 3 for s in seq.tolist()]
    assert out.keep[0, 0] != out.keep[1, 0]  # the bound separates the two sequences


def test_token_rule_with_both_k1_bounds_and_the_clamp():
    """token_k1 keeps log(lo) <= -y <= log(hi); the masked y = 50 is clamped to 20 (verl's clamp) and rejected."""
    rule = RejectionRule(statistic="k1", aggregation="token", min=-0.25, max=0.4)
    out = evaluate_rule(rule, PREV, GEN, MASK, LAY)
    assert out.seq_stat is None
    assert out.token_stat[1, 2].item() == -20.0
    assert out.keep.tolist() == [[True, True, False], [False, True, False], [False, False, False]]


def test_several_rules_must_all_pass():
    a = RejectionRule(statistic="k2", aggregation="sequence_max", max=0.1)  # seq 1 has y = -0.5: k2 = 0.125
    b = RejectionRule(statistic="k1", aggregation="token", min=-0.25)  # rejects the token with y = 0.3
    keep, outcomes = evaluate_rules([a, b], PREV, GEN, MASK, LAY)
    assert [o.name for o in outcomes] == ["sequence_max_k2", "token_k1"]
    assert torch.equal(keep, outcomes[0].keep & outcomes[1].keep)
    assert keep[:2].tolist() == [[True, True, False], [False, False, False]]


def test_packed_layout_gives_the_padded_statistics():
    lengths = [3, 2]
    flat_y = torch.cat([Y[0, :3], Y[1, :2]])
    packed = TokenLayout.packed([0, 3, 5])
    p = torch.full((5,), -1.0, dtype=F64)
    for agg in ("sequence_sum", "sequence_mean", "sequence_max"):
        rule = RejectionRule(statistic="k3", aggregation=agg, max=0.01)
        got = evaluate_rule(rule, p, p - flat_y, torch.ones(5, dtype=F64), packed)
        want = evaluate_rule(rule, PREV, GEN, MASK, LAY)
        torch.testing.assert_close(got.seq_stat, want.seq_stat[:2], rtol=1e-12, atol=0)
        assert got.keep.tolist() == [bool(v) for i, n in enumerate(lengths) for v in want.keep[i, :n]]


def test_the_shorthand_band_is_a_k1_rule():
    """importance_sampling_rejection seq-mis / geo-rs keeps a sequence while lo <= exp(sum_t y) (resp. exp(mean_t y))
    <= hi: sums 0.2 / -0.45 / 0 (empty), means 0.0667 / -0.225 / 0. Computed by hand, and the same as the explicit k1
    rule on [-log hi, -log lo]."""
    kw = dict(
        level="token",
        nemo_rl_exact=False,
        apply_weights=True,
        truncation=None,
        low=None,
        high=None,
        veto_threshold=None,
        batch_normalize=False,
    )
    for kind, band, stat in (("seq-mis", (0.7, 1.3), "sequence_sum"), ("geo-rs", (0.9, 1.1), "sequence_mean")):
        shorthand = compute_is_correction(
            PREV, GEN, MASK, MASK, LAY, rejection=kind, rejection_low=band[0], rejection_high=band[1], **kw
        )
        assert shorthand.rejected.tolist() == [[False] * 3, [True] * 3, [False] * 3], kind
        rule = RejectionRule(
            statistic="k1", aggregation=stat, min=-math.log(band[1]), max=-math.log(band[0]), log_ratio_clamp=None
        )
        as_rule = compute_is_correction(PREV, GEN, MASK, MASK, LAY, rules=[rule], **kw)
        assert torch.equal(shorthand.weights, as_rule.weights) and torch.equal(shorthand.rejected, as_rule.rejected)


def test_rules_reject_after_batch_normalisation_and_report_per_rule_metrics():
    cfg = ClippedPGLossConfig(
        reference_policy_kl_penalty=0.0,
        use_importance_sampling_correction=True,
        is_correction_level="token",
        importance_sampling_batch_normalize=True,
        importance_sampling_rejection_rules=[{"option": "seq_max_k2", "threshold": 0.1}],
    )
    from nemo_is_plugin.loss import ClippedPGLoss, LossInputs

    c = PREV.clone().requires_grad_(True)
    inputs = LossInputs(c, PREV, GEN, None, torch.ones_like(PREV), MASK, torch.ones(3, dtype=F64), 3.0, 5.0)
    _, metrics = ClippedPGLoss(cfg).compute(inputs, LAY)
    # seq 1 (max k2 = 0.125 > 0.1) is rejected: 2 of 5 valid tokens, 1 of 3 sequences
    assert metrics["is_rejection_sequence_max_k2_rejected_fraction"] == pytest.approx(2 / 5)
    assert metrics["is_rejection_sequence_max_k2_rejected_seq_fraction"] == pytest.approx(1 / 3)
    assert metrics["is_rejection_rejected_fraction"] == pytest.approx(2 / 5)
    assert metrics["is_rejection_sequence_max_k2_max"] == pytest.approx(0.125)
    assert metrics["is_rejection_sequence_max_k2_min"] == pytest.approx(0.045)
    mean_k2 = (3 * 0.045 + 2 * 0.125) / 5  # each token carries its sequence's statistic
    assert metrics["is_rejection_sequence_max_k2_mean"] == pytest.approx(mean_k2)
    # batch normalisation divides by the mean weight of all valid tokens, rejected ones included (as verl)
    w = torch.exp(Y)[MASK > 0]
    assert metrics["is_weight_mean"] == pytest.approx(float(w[:3].sum() / w.mean()) / 5, rel=1e-7)  # / (5 + 1e-8)


def test_batch_normalised_weights_of_masked_samples_never_reach_the_gradient():
    """Found by the property test: sequence-level IS with batch normalisation divides every weight by the mean of the
    counted sequences'; when that mean is a float32 denormal (log w = -90 on the one counted sequence), a sample masked
    out by sample_mask (log w = 0, weight 1) gets 1 / 8e-40 = inf, and the loss's where (a zero gradient there) times
    inf made its gradient NaN. Masked samples contribute exactly 0; the counted sequence's gradient is
    -A w / factor = -A (its weight normalised to 1), token by token over the global count."""
    from nemo_is_plugin.loss import ClippedPGLoss

    b, s = 3, 5
    prev = torch.zeros(b, s)
    prev[0, 1:] = -90.0 / (s - 1)  # row 0: log w = sum(prev - gen) = -90 over its 4 aligned tokens
    data = {
        "token_mask": torch.ones(b, s),
        "sample_mask": torch.tensor([1.0, 0.0, 0.0]),
        "advantages": torch.ones(b, s),
        "prev_logprobs": prev,
        "generation_logprobs": torch.zeros(b, s),
    }
    cfg = ClippedPGLossConfig(
        reference_policy_kl_penalty=0.0,
        use_importance_sampling_correction=True,
        is_correction_level="sequence",
        importance_sampling_batch_normalize=True,
        disable_ppo_ratio=True,
    )
    c = torch.full((b, s - 1), -0.5, requires_grad=True)
    loss, _ = ClippedPGLoss(cfg)(c, data, global_valid_seqs=1.0, global_valid_toks=4.0)
    loss.backward()
    assert torch.isfinite(loss)
    assert torch.equal(c.grad[1:], torch.zeros(2, s - 1))
    torch.testing.assert_close(c.grad[0], torch.full((s - 1,), -1.0 / 4.0))
