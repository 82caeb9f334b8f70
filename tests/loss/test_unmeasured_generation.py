"""A generation log-prob that is not finite on a valid token (vLLM reports -inf for a token its sampler filtered), and
the other edge inputs issue 31 found mishandled, by hand in float64 (docs/config.md, "Edge inputs").

Each test below failed before its fix: the explicit IS levels capped log w = +inf at 30 (weight e^30 instead of 0, the
TIS cap under tis; loss -1.1e11); NaN through tis_log gave a NaN loss; a NaN generation log-prob in padding reached a
weight and made the gradient NaN (0 * NaN); a packed layout's cumulative weights after a sequence with -inf were 0
(inf - inf in the segmented prefix sum); rule statistics and the veto read NaN (NaN metrics, a vetoed sequence);
bypass mode divided by a -inf pi_old (NaN loss); an overflowing policy ratio gave an inf loss or a NaN gradient; a
masked-out sample's values moved NeMo-RL's GSPO metric; a bad curr_logprobs_unfiltered entry was reported one
column off.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from nemo_is_plugin import ClippedPGLossConfig, build_loss_fn
from nemo_is_plugin.common import once
from nemo_is_plugin.loss.correction import compute_is_correction
from nemo_is_plugin.loss.layout import TokenLayout
from nemo_is_plugin.loss.output_checks import NonFiniteLossError
from nemo_is_plugin.loss.rejection import Rule
from nemo_is_plugin.loss.terms import is_correction_kwargs

F64 = torch.float64
B, T = 3, 5
_g = torch.Generator().manual_seed(31)
PREV = -(torch.rand(B, T, generator=_g, dtype=F64) * 1.5 + 0.1)
GEN = (PREV + 0.1 * torch.randn(B, T, generator=_g, dtype=F64)).clamp(max=-1e-3)
MASK = torch.ones(B, T, dtype=F64)
MASK[2, 4] = 0
LAY = TokenLayout.padded(B, T)
BAD = (0, 2)  # a valid token of row 0, with two tokens after it
# the weights each level gives 0 for BAD: the token; its row; the token and the later tokens of its row
ZEROED = {"token": [BAD], "sequence": [(0, j) for j in range(T)], "sequence_mean": [(0, j) for j in range(T)]}
ZEROED["cumulative"] = [(0, j) for j in range(2, T)]
TRUNCATIONS = {None: (None, None), "tis": (None, 2.0), "tis_min": (0.5, 2.0), "icepop": (0.5, 5.0)}


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(once, "_WARNED", set())


def correction(gen, level, truncation=None, *, nemo_rl_exact=False, layout=LAY, prev=PREV, mask=MASK, **kw):
    low, high = TRUNCATIONS[truncation]
    opts = dict(veto_threshold=None, batch_normalize=False, apply_weights=True)
    opts.update(kw)
    kind = "tis" if truncation == "tis_min" else truncation
    return compute_is_correction(
        prev,
        gen,
        mask,
        mask,
        layout,
        level=level,
        nemo_rl_exact=nemo_rl_exact,
        truncation=kind,
        low=low,
        high=high,
        **opts,
    )


def with_value(value: float, at=BAD) -> torch.Tensor:
    gen = GEN.clone()
    gen[at] = value
    return gen


def zero_mask(level: str) -> torch.Tensor:
    z = torch.zeros(B, T, dtype=torch.bool)
    for i, j in ZEROED[level]:
        z[i, j] = True
    return z


@pytest.mark.parametrize("truncation", list(TRUNCATIONS))
@pytest.mark.parametrize("level", list(ZEROED))
@pytest.mark.parametrize("value", [-math.inf, math.nan, math.inf])
def test_every_weight_whose_log_sum_holds_the_term_is_zero(level, truncation, value):
    """Explicit levels: 0 (not e^30, not the TIS cap or min) for the weights whose log-sum contains the term; every
    other weight is the one of the same batch with that term 0 (the oracle: gen = prev there)."""
    got = correction(with_value(value), level, truncation)
    oracle = correction(with_value(PREV[BAD].item()), level, truncation)
    zero = zero_mask(level)
    assert (got.weights[zero] == 0).all() and (got.raw_weights[zero] == 0).all()
    assert got.rejected[zero].all()
    torch.testing.assert_close(got.weights[~zero], oracle.weights[~zero], rtol=0, atol=0)
    assert torch.isfinite(got.weights).all()


@pytest.mark.parametrize("value", [-math.inf, math.nan, math.inf])
def test_the_nemo_rl_exact_level_keeps_nemo_rl_rule(value):
    """Level unset: NeMo-RL's nan_to_num(exp(log w)) = 0, then tis lifts it to its min (golden 089's order)."""
    assert correction(with_value(value), "token", nemo_rl_exact=True).weights[BAD].item() == 0.0
    assert correction(with_value(value), "token", "tis", nemo_rl_exact=True).weights[BAD].item() == 0.0
    assert correction(with_value(value), "token", "tis_min", nemo_rl_exact=True).weights[BAD].item() == 0.5
    seq = correction(with_value(value), "sequence", nemo_rl_exact=True)
    assert (seq.weights[0] == 0).all() and (seq.weights[1:][MASK[1:] != 0] > 0).all()


def test_batch_normalisation_counts_the_zero_and_is_not_poisoned():
    got = correction(with_value(-math.inf), "token", batch_normalize=True)
    oracle = correction(with_value(PREV[BAD].item()), "token")
    kept = oracle.weights.clone()
    kept[BAD] = 0.0
    factor = kept[MASK != 0].sum() / (MASK != 0).sum()
    assert got.batch_norm_factor.item() == pytest.approx(factor.item(), rel=1e-15)
    torch.testing.assert_close(got.weights[MASK != 0], (kept / factor)[MASK != 0], rtol=1e-15, atol=0)


def test_packed_cumulative_weights_after_a_minus_inf_equal_the_padded_ones():
    """The packed prefix sum subtracts running totals: an inf there made every later sequence's weights 0."""
    gen = with_value(-math.inf)
    padded = correction(gen, "cumulative")
    lengths = [T, T, T - 1]
    cu = [0, T, 2 * T, 3 * T - 1]
    flat = lambda t: torch.cat([t[i, :n] for i, n in enumerate(lengths)])  # noqa: E731
    packed = correction(
        flat(gen), "cumulative", layout=TokenLayout.packed(cu), prev=flat(PREV), mask=torch.ones(cu[-1], dtype=F64)
    )
    torch.testing.assert_close(packed.weights, flat(padded.weights), rtol=1e-15, atol=0)
    assert (packed.weights[T:] > 0).all()


def test_rule_statistics_and_the_veto_count_a_nan_as_zero():
    """A NaN has no clamp value: every statistic counts it 0 (it was NaN: NaN metrics, a rejected sequence)."""
    rules = (Rule("k1", "token", -1.0, 1.0, 20.0), Rule("k2", "sequence_max", None, 2.0, 20.0))
    rules += (Rule("prob_diff", "sequence_sum", None, 5.0),)
    got = correction(with_value(math.nan), "token", rules=rules, veto_threshold=0.5)
    for outcome in got.rules:
        assert torch.isfinite(outcome.token_stat).all(), outcome.name
    assert got.rules[0].token_stat[BAD].item() == 0.0
    assert got.weights[BAD].item() == 0.0
    others = MASK.bool().clone()
    others[BAD] = False
    oracle = correction(with_value(PREV[BAD].item()), "token", rules=rules, veto_threshold=0.5)
    torch.testing.assert_close(got.weights[others], oracle.weights[others], rtol=0, atol=0)


@pytest.mark.parametrize("value", [-math.inf, math.inf])
def test_a_clamped_rule_sees_an_infinite_term_as_its_clamp(value):
    """verl's value: y = clamp(-+inf) = +-20, k1 = -+20: the token rule rejects it (the weight rule drops it anyway),
    and a sequence rule counts it as such; unclamped, it counts 0."""
    rules = (Rule("k1", "token", -1.0, 1.0, 20.0), Rule("k1", "sequence_sum", -100.0, 100.0, None))
    got = correction(with_value(value), "token", rules=rules)
    assert got.rules[0].token_stat[BAD].item() == math.copysign(20.0, value) and got.weights[BAD].item() == 0.0
    oracle = correction(with_value(PREV[BAD].item()), "token", rules=rules)
    torch.testing.assert_close(got.rules[1].seq_stat, oracle.rules[1].seq_stat, rtol=0, atol=0)


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_the_veto_skips_a_non_finite_term(value):
    """A veto on the smallest token weight: +inf generation (x = -inf) or NaN vetoed the whole sequence."""
    got = correction(with_value(value), "token", veto_threshold=0.5)
    assert got.weights[BAD].item() == 0.0 and (got.weights[0, [0, 1, 3, 4]] > 0).all()


def test_a_rejection_without_is_weights_drops_the_token_itself():
    rule = Rule("k1", "sequence_mean", -1.0, 1.0, None)  # unclamped: the term counts 0, the sequence is kept
    got = correction(with_value(-math.inf), "sequence", rules=(rule,), apply_weights=False)
    assert got.weights[BAD].item() == 0.0
    others = MASK.bool().clone()
    others[BAD] = False
    assert (got.weights[others] == 1.0).all()


# ---------------------------------------------------------------------------------------------------- the loss
def nemo_rl_batch(dtype=torch.float32):
    """A [2, 6] NeMo-RL batch (column 0 the prompt)."""
    g = torch.Generator().manual_seed(7)
    lp = lambda: (-torch.rand(2, 6, generator=g, dtype=F64) * 2 - 0.05).to(dtype)  # noqa: E731
    tm = torch.ones(2, 6)
    tm[:, 0] = 0
    tm[1, 5] = 0
    data = {
        "token_mask": tm,
        "sample_mask": torch.ones(2),
        "advantages": torch.randn(2, 6, generator=g).to(dtype),
        "prev_logprobs": lp(),
        "reference_policy_logprobs": lp(),
    }
    data["generation_logprobs"] = (data["prev_logprobs"] - 0.05).to(dtype)
    curr = (data["prev_logprobs"][:, 1:] + 0.02).clamp(max=-1e-3)
    return curr, data


def call(cfg: dict, curr, data):
    x = curr.clone().requires_grad_(True)
    n_tok = (data["token_mask"][:, 1:] * data["sample_mask"][:, None]).sum()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loss, metrics = build_loss_fn(cfg)(x, data, data["sample_mask"].sum(), n_tok)
    loss.backward()
    return loss.detach(), x.grad, metrics


GRPO = dict(reference_policy_kl_penalty=0.01, ratio_clip_min=0.2, ratio_clip_max=0.2)
GRPO["use_importance_sampling_correction"] = True
TIS = dict(truncated_importance_sampling_type="tis", truncated_importance_sampling_ratio=2.0)


@pytest.mark.parametrize("truncation", [{}, TIS])
def test_the_explicit_token_level_is_nemo_rl_exact_path_spelled_out(truncation):
    """The issue's case: NeMo-RL's GRPO defaults + IS and one -inf generation log-prob on a valid token."""
    curr, data = nemo_rl_batch()
    data["generation_logprobs"][0, 3] = -math.inf
    nemo_rl_path = call({**GRPO, **truncation}, curr, data)
    token = call({**GRPO, **truncation, "is_correction_level": "token"}, curr, data)
    torch.testing.assert_close(token[0], nemo_rl_path[0], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(token[1], nemo_rl_path[1], rtol=1e-6, atol=1e-7)
    assert abs(nemo_rl_path[0].item()) < 5 and token[2]["is_weight_max"] < 10
    for level in ("sequence", "sequence_mean", "cumulative"):
        loss, grad, metrics = call({**GRPO, **truncation, "is_correction_level": level}, curr, data)
        assert abs(loss.item()) < 5 and grad.abs().max() < 5 and metrics["is_weight_max"] < 10, level


def test_a_nan_generation_log_prob_under_tis_at_an_explicit_level_is_finite():
    curr, data = nemo_rl_batch()
    data["generation_logprobs"][0, 3] = math.nan
    cfg = dict(GRPO, is_correction_level="token", truncated_importance_sampling_type="tis")
    loss, grad, metrics = call({**cfg, "truncated_importance_sampling_ratio": 2.0}, curr, data)
    assert torch.isfinite(loss) and torch.isfinite(grad).all() and math.isfinite(metrics["is_weight_mean"])


@pytest.mark.parametrize("value", [math.nan, -math.inf])
def test_a_non_finite_generation_log_prob_in_padding_changes_nothing(value):
    """A masked NaN reached a weight (tis_log(NaN)) and, through 0 * NaN in the backward, the gradient."""
    cfg = dict(GRPO, is_correction_level="token", truncated_importance_sampling_type="tis")
    cfg.update(truncated_importance_sampling_ratio=2.0, log_ratio_clip_low=0.2, log_ratio_clip_high=0.28)
    cfg.update(importance_sampling_rejection="geo-rs", importance_sampling_rejection_min=0.8)
    cfg["importance_sampling_rejection_max"] = 1.25
    curr, data = nemo_rl_batch()
    clean = call(cfg, curr, data)
    data["generation_logprobs"][1, 5] = value  # token_mask[1, 5] = 0
    loss, grad, metrics = call(cfg, curr, data)
    assert torch.equal(loss, clean[0]) and torch.equal(grad, clean[1])
    assert metrics == clean[2]


def test_bypass_mode_refuses_a_non_finite_generation_log_prob():
    """old_policy_logprobs: generation makes them pi_old: the ratio exp(c - (-inf)) gave a NaN loss."""
    curr, data = nemo_rl_batch()
    data["generation_logprobs"][0, 3] = -math.inf
    with pytest.raises(ValueError, match=r"^data\['generation_logprobs'\] \(pi_old.*first at \[0, 3\] = -inf") as e:
        call(dict(GRPO, old_policy_logprobs="generation"), curr, data)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("clip", [{}, dict(ratio_clip_c=3.0), dict(log_ratio_clip_low=0.2, log_ratio_clip_high=0.28)])
def test_an_overflowing_policy_ratio_is_refused_in_one_line(clip):
    """prev 120 nats below the current log-prob (a sentinel on a valid token): NeMo-RL's loss is inf, or finite with a
    NaN gradient under the dual clip; refused naming prev_logprobs. With max_log_ratio the same batch is finite."""
    curr, data = nemo_rl_batch()
    data["prev_logprobs"][0, 3] = -120.0
    data["advantages"][0, 3] = -1.0
    with pytest.raises(NonFiniteLossError, match=r"prev_logprobs on a valid token is 1\d\d.* at token \[0, 2\]") as e:
        call({**GRPO, **clip}, curr, data)
    assert "\n" not in str(e.value) and "max_log_ratio" in str(e.value)
    loss, grad, _ = call({**GRPO, **clip, "max_log_ratio": 10.0}, curr, data)
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    data64 = {k: v.double() if v.is_floating_point() else v for k, v in data.items()}
    loss, grad, _ = call({**GRPO, **clip}, curr.double(), data64)  # e^119 is a float64
    assert torch.isfinite(loss) and torch.isfinite(grad).all()


def test_a_masked_out_sample_does_not_move_nemo_rl_s_gspo_metric():
    """NeMo-RL's GSPO sampling_importance_ratio sums every row's weight; a rejection of the masked-out row (on
    its own huge mismatch) made it 0 there."""
    cfg = dict(GRPO, sequence_level_importance_ratios=True, token_level_loss=False)
    cfg.update(importance_sampling_rejection="geo-rs", importance_sampling_rejection_min=0.8)
    cfg["importance_sampling_rejection_max"] = 1.25
    curr, data = nemo_rl_batch()
    data["sample_mask"] = torch.tensor([1.0, 0.0])
    clean = call(cfg, curr, data)
    data["generation_logprobs"][1, 2] = -120.0
    assert call(cfg, curr, data)[2] == clean[2]


def test_a_bad_unfiltered_log_prob_is_reported_at_its_own_index():
    """data['curr_logprobs_unfiltered'] is [B, S-1] already: its index was shifted by one column like a [B, S] key."""
    curr, data = nemo_rl_batch()
    data["curr_logprobs_unfiltered"] = curr.clone()
    data["curr_logprobs_unfiltered"][1, 2] = math.nan
    bad = r"curr_logprobs_unfiltered'\] contains NaN or inf; 1 bad element\(s\), first at \[1, 2\]"
    with pytest.raises(ValueError, match=bad):
        call(GRPO, curr, data)


def test_the_config_space_weights_agree_with_compute_is_correction():
    """The loss reports the weights of compute_is_correction (the function every path calls) for a -inf token."""
    curr, data = nemo_rl_batch(F64)
    data["generation_logprobs"][0, 3] = -math.inf
    cfg = ClippedPGLossConfig(**GRPO, is_correction_level="cumulative")
    p, g, tm = (data[k][:, 1:] for k in ("prev_logprobs", "generation_logprobs", "token_mask"))
    corr = compute_is_correction(p, g, tm.double(), tm.double(), TokenLayout.padded(2, 5), **is_correction_kwargs(cfg))
    assert (corr.weights[0, 2:] == 0).all() and (corr.weights[0, :2] > 0).all()
    _, _, metrics = call(cfg.model_dump(exclude_defaults=True), curr, data)
    assert metrics["is_weight_max"] == pytest.approx(corr.weights[tm != 0].max().item(), rel=1e-12)
