"""The probability-difference rejection statistic D_t = |pi_prev - mu| of the sampled token: hand-computed per token
and per sequence (padding, a masked token, a -inf rollout log-prob), against a float64 reference from bf16 / float32
inputs, its config bounds, and its composition with the k-rules, every IS level and truncation type, and the metrics."""

import math
from typing import get_args

import pydantic
import pytest
import torch

from nemo_is_plugin.config import VERL_RS_OPTIONS, ISCorrectionLevel, RejectionRule, TruncationType
from nemo_is_plugin.loss import ClippedPGLoss, LossInputs
from nemo_is_plugin.loss.config_model import ClippedPGLossConfig
from nemo_is_plugin.loss.correction import compute_is_correction
from nemo_is_plugin.loss.layout import TokenLayout
from nemo_is_plugin.loss.ratios import probability_difference
from nemo_is_plugin.loss.rejection import evaluate_rule, evaluate_rules

F64 = torch.float64
# pi_prev and mu per token. Seq 0's last token has mu = 0 (log mu = -inf: outside the filtered sampling support), seq
# 1's last token is masked (its D = 0.8 must not count), seq 2 has no tokens.
PI = [[0.5, 0.2, 0.9], [0.4, 0.6, 0.1], [0.3, 0.3, 0.3]]
MU = [[0.3, 0.25, 0.0], [0.4, 0.1, 0.9], [0.3, 0.3, 0.3]]
PREV = torch.tensor(PI, dtype=F64).log()
GEN = torch.tensor(MU, dtype=F64).log()
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [0.0, 0.0, 0.0]], dtype=F64)
LAY = TokenLayout.padded(3, 3)
D = [[0.2, 0.05, 0.9], [0.0, 0.5, 0.8], [0.0, 0.0, 0.0]]
# by hand over the unmasked tokens: seq 0 {0.2, 0.05, 0.9}, seq 1 {0.0, 0.5}, seq 2 {} (statistic 0)
SEQ = {
    "sequence_sum": [1.15, 0.5, 0.0],
    "sequence_mean": [1.15 / (3 + 1e-8), 0.5 / (2 + 1e-8), 0.0],
    "sequence_max": [0.9, 0.5, 0.0],
}


def rule(aggregation: str, max: float) -> RejectionRule:
    return RejectionRule(statistic="prob_diff", aggregation=aggregation, max=max)


def test_token_statistic_by_hand_with_a_minus_inf_rollout_log_prob():
    assert torch.isneginf(GEN[0, 2])
    got = probability_difference(PREV, GEN)
    torch.testing.assert_close(got, torch.tensor(D, dtype=F64), rtol=0, atol=1e-15)
    out = evaluate_rule(rule("token", 0.3), PREV, GEN, MASK, LAY)
    assert out.name == "token_prob_diff" and out.seq_stat is None
    assert out.keep.tolist() == [[True, True, False], [True, False, False], [True, True, True]]
    both_inf = probability_difference(torch.tensor([-math.inf]), torch.tensor([-math.inf]))
    assert both_inf.tolist() == [0.0]  # two zero probabilities: no inf - inf, no NaN


@pytest.mark.parametrize(
    "aggregation, bound, kept",
    [("sequence_sum", 1.0, [False, True, True]), ("sequence_mean", 0.3, [False, True, True])]
    + [("sequence_max", 0.6, [False, True, True]), ("sequence_max", 0.45, [False, False, True])],
)
def test_sequence_statistics_by_hand(aggregation, bound, kept):
    """sequence_max 0.6 keeps seq 1 although its masked token has D = 0.8: masked tokens do not count."""
    out = evaluate_rule(rule(aggregation, bound), PREV, GEN, MASK, LAY)
    torch.testing.assert_close(out.seq_stat, torch.tensor(SEQ[aggregation], dtype=F64), rtol=0, atol=1e-14)
    torch.testing.assert_close(out.token_stat, out.seq_stat[:, None].expand(3, 3))
    assert out.keep.tolist() == [[k] * 3 for k in kept]


def test_packed_layout_gives_the_padded_statistics():
    packed = TokenLayout.packed([0, 3, 5])
    p, g = torch.cat([PREV[0], PREV[1, :2]]), torch.cat([GEN[0], GEN[1, :2]])
    for aggregation, bound in (("sequence_sum", 1.0), ("sequence_mean", 0.3), ("sequence_max", 0.6)):
        got = evaluate_rule(rule(aggregation, bound), p, g, torch.ones(5, dtype=F64), packed)
        torch.testing.assert_close(got.seq_stat, torch.tensor(SEQ[aggregation][:2], dtype=F64), rtol=0, atol=1e-14)
        assert got.keep.tolist() == [False] * 3 + [True] * 2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_low_precision_inputs_against_float64(dtype):
    """bf16 / float32 log-probs: D in float32 (at least), within float32 rounding of the float64 D of the same
    values; a bf16 D would be off by up to 2^-9 near probability 1."""
    g = torch.Generator().manual_seed(0)
    prev = torch.log(torch.rand(4, 64, generator=g, dtype=F64) * 0.999 + 1e-4).to(dtype)
    gen = (prev.double() + 0.3 * torch.randn(4, 64, generator=g, dtype=F64)).clamp(max=0.0).to(dtype)
    gen[0, 0] = -math.inf
    mask = (torch.rand(4, 64, generator=g) < 0.8).double()
    mask[3] = 0
    got = probability_difference(prev, gen)
    assert got.dtype == torch.float32
    want = (prev.double().exp() - gen.double().exp()).abs()
    torch.testing.assert_close(got.double(), want, rtol=0, atol=2e-7)
    lay = TokenLayout.padded(4, 64)
    for aggregation in SEQ:
        seq = evaluate_rule(rule(aggregation, 0.5), prev, gen, mask.to(dtype), lay).seq_stat
        vals = [[d for d, m in zip(r, mr) if m] for r, mr in zip(want.tolist(), mask.tolist())]
        ref = {
            "sequence_sum": [sum(v) for v in vals],
            "sequence_mean": [sum(v) / (len(v) + 1e-8) for v in vals],
            "sequence_max": [max(v) if v else 0.0 for v in vals],
        }[aggregation]
        torch.testing.assert_close(seq.double(), torch.tensor(ref, dtype=F64), rtol=1e-6, atol=1e-6)
        assert seq[3].item() == 0.0  # the sequence without tokens


# Milder pairs (every ratio pi / mu in [0.5, 2], token, prefix and sequence products too): D = 0.1, 0.05, 0.4 | 0,
# 0.1, (0.01 masked) | 0, 0, 0; y = log(pi / mu) = log 1.25, log 0.8, log 1.8 | 0, log 1.2, log(10/9) | 0, 0, 0.
MILD_PREV = torch.tensor([[0.5, 0.2, 0.9], [0.4, 0.6, 0.1], [0.3, 0.3, 0.3]], dtype=F64).log()
MILD_GEN = torch.tensor([[0.4, 0.25, 0.5], [0.4, 0.5, 0.09], [0.3, 0.3, 0.3]], dtype=F64).log()


def test_composes_with_a_k_rule():
    """Both must pass: token prob_diff <= 0.3 rejects (0, 2) (D = 0.4); token k1 <= 0.2 rejects (0, 1)
    (k1 = -log 0.8 = 0.223) and keeps the rest (k1 <= 0)."""
    k1 = RejectionRule(statistic="k1", aggregation="token", max=0.2)
    keep, outcomes = evaluate_rules([rule("token", 0.3), k1], MILD_PREV, MILD_GEN, MASK, LAY)
    assert [o.name for o in outcomes] == ["token_prob_diff", "token_k1"]
    assert outcomes[0].keep[0].tolist() == [True, True, False] and outcomes[1].keep[0].tolist() == [True, False, True]
    assert keep.tolist() == [[True, False, False], [True, True, True], [True, True, True]]


IS_KW = dict(nemo_rl_exact=False, apply_weights=True, veto_threshold=None, batch_normalize=False)
BOUNDS = {"tis": (2.0, None), "icepop": (2.0, 0.5), "seq-mask-tis": (2.0, 0.5), "seq-mis": (1e3, 1e-3)}
BOUNDS["geo-rs"] = (1e3, 1e-3)


@pytest.mark.parametrize("level", get_args(ISCorrectionLevel))
@pytest.mark.parametrize("truncation", [None, *get_args(TruncationType)])
def test_rejects_on_top_of_every_is_level_and_truncation(level, truncation):
    """With the rule, the weights are those without it times its keep mask, and it rejects exactly what it rejects
    on top of what the level and truncation already reject (the mild pairs: no truncation rejects them)."""
    high, low = BOUNDS.get(truncation, (None, None))
    kw = dict(IS_KW, level=level, truncation=truncation, high=high, low=low)
    plain = compute_is_correction(MILD_PREV, MILD_GEN, MASK, MASK, LAY, **kw)
    keep = evaluate_rule(rule("token", 0.3), MILD_PREV, MILD_GEN, MASK, LAY).keep
    with_rule = compute_is_correction(MILD_PREV, MILD_GEN, MASK, MASK, LAY, rules=[rule("token", 0.3)], **kw)
    assert torch.equal(with_rule.rejected, plain.rejected | ~keep)
    torch.testing.assert_close(with_rule.weights, torch.where(keep, plain.weights, 0.0), rtol=0, atol=0)
    assert not plain.rejected[MASK > 0].any()
    assert with_rule.rejected[MASK > 0].tolist() == [False, False, True, False, False]  # (0, 2): D = 0.4


def test_metrics_of_the_rule():
    """Per rule is_rejection_sequence_max_prob_diff_*: seq 0 (max 0.9, 3 tokens) rejected, seq 1 (max 0.5, 2 tokens)
    kept, seq 2 without tokens; as each k-rule reports."""
    cfg = ClippedPGLossConfig(
        reference_policy_kl_penalty=0.0,
        importance_sampling_rejection_rules=[{"statistic": "prob_diff", "aggregation": "sequence_max", "max": 0.6}],
    )
    gen = GEN.clone()
    gen[0, 2] = math.log(1e-6)  # a finite rollout log-prob: the mismatch metrics need one; D = 0.9 - 1e-6
    c = PREV.clone().requires_grad_(True)
    inputs = LossInputs(c, PREV, gen, None, torch.ones_like(PREV), MASK, torch.ones(3, dtype=F64), 3.0, 5.0)
    _, metrics = ClippedPGLoss(cfg).compute(inputs, LAY)
    name = "is_rejection_sequence_max_prob_diff"
    assert metrics[f"{name}_rejected_fraction"] == pytest.approx(3 / 5)
    assert metrics[f"{name}_rejected_seq_fraction"] == pytest.approx(1 / 3)
    assert metrics["is_rejection_rejected_fraction"] == pytest.approx(3 / 5)
    assert metrics[f"{name}_max"] == pytest.approx(0.9 - 1e-6)
    assert metrics[f"{name}_min"] == pytest.approx(0.5)
    assert metrics[f"{name}_mean"] == pytest.approx((3 * (0.9 - 1e-6) + 2 * 0.5) / 5)


# ---------------------------------------------------------------------------------------------------------- config
def test_config_accepts_max_up_to_one_and_has_no_clamp_nor_verl_option():
    r = rule("sequence_mean", 1.0)
    assert r.log_ratio_clamp is None and r.verl_option is None and r.name == "sequence_mean_prob_diff"
    assert RejectionRule(statistic="prob_diff", aggregation="seq_max", max=0.1).aggregation == "sequence_max"
    assert not any("prob_diff" in option for option in VERL_RS_OPTIONS)
    cfg = ClippedPGLossConfig(importance_sampling_rejection_rules=[r.model_dump()])
    assert ClippedPGLossConfig(**cfg.model_dump()) == cfg  # round trip


@pytest.mark.parametrize(
    "fields, match",
    [
        ({"max": 1.5}, r"token_prob_diff: max=1.5 must be in \(0, 1\]"),
        ({"max": 0.0}, r"max=0.0 must be in \(0, 1\]"),
        ({"max": -0.1}, r"max=-0.1 must be in \(0, 1\]"),
        ({"max": True}, "not a boolean"),
        ({"max": math.inf}, "finite"),
        ({}, "token_prob_diff needs max"),
        ({"min": 0.1, "max": 0.5}, "only max bounds it; unset min"),
        ({"max": 0.5, "log_ratio_clamp": 20.0}, "log_ratio_clamp=20.0 does not apply.*unset it"),
    ],
)
def test_bad_prob_diff_rules_are_refused_naming_the_fix(fields, match):
    with pytest.raises(pydantic.ValidationError, match=match):
        ClippedPGLossConfig(
            importance_sampling_rejection_rules=[{"statistic": "prob_diff", "aggregation": "token", **fields}]
        )


def test_verl_form_has_no_prob_diff_option():
    with pytest.raises(pydantic.ValidationError, match="not one of verl's.*statistic: prob_diff"):
        RejectionRule(option="token_prob_diff", threshold=0.1)
