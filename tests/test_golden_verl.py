"""verl rollout-correction golden cases (tests/data/golden/verl_rollout_corr, produced by verl's
rollout_corr_helper.compute_rollout_correction_and_rejection_mask at b178a3cd), run through the project's own mapping
of verl's ``algorithm.rollout_correction`` (nemo_is_plugin.adapters.verl.config.rollout_correction_keys): the IS
weights and rejection masks the plugin's loss applies, and verl's ``rollout_corr/`` metrics
(nemo_is_plugin.adapters.verl.metrics) at the README's tolerances.

verl has no sample mask: every row is a sample (sample_mask = 1, global_valid_seqs = B, global_valid_toks = #unmasked).
The loss is called at ratio 1 with advantage 1 under token-mean, so -N_tok * d loss / d curr_t is exactly the weight
the loss applies to token t: verl's rollout_is_weights (1 without IS) times its modified response mask.
"""

from __future__ import annotations

import math
import re

import pytest
import torch
from helpers.golden_utils import case_ids, load_named_cases
from helpers.golden_verl import loss_inputs, plugin_keys

from nemo_is_plugin import build_loss_fn, finalize_metrics
from nemo_is_plugin.adapters.verl.config import (
    preset_settings,
    rejection_rules,
)
from nemo_is_plugin.adapters.verl.metrics import PREFIX, rollout_corr_metrics
from nemo_is_plugin.config import VERL_RS_OPTIONS
from nemo_is_plugin.loss.config_model import ClippedPGLossConfig
from nemo_is_plugin.loss.correction import compute_is_correction
from nemo_is_plugin.loss.is_weights import MAX_LOG_WEIGHT
from nemo_is_plugin.loss.terms import is_correction_kwargs

CASES = load_named_cases("verl_rollout_corr")
VALID = [c for c in CASES if "error" not in c["expected"]]
ERRORS = [c for c in CASES if "error" in c["expected"]]
BY_ID = {c["id"]: c for c in CASES}
WITH_RS = [c for c in VALID if c["params"]["rollout_rs"] is not None]
PRESETS = [c for c in VALID if c["params"]["preset"] is not None]


def correction(keys: dict, case: dict):
    """compute_is_correction with exactly the arguments clipped_pg.py passes for this config."""
    cfg = ClippedPGLossConfig(**keys)
    inputs, layout = loss_inputs(case)
    tm = inputs.token_mask
    return compute_is_correction(
        inputs.prev_logprobs, inputs.generation_logprobs, tm, tm, layout, **is_correction_kwargs(cfg)
    )


def applied_weights(keys: dict, case: dict):
    """(weights the loss applies per token, its metrics) from a real loss call (see the module docstring)."""
    inputs, layout = loss_inputs(case)
    loss, metrics = build_loss_fn(keys).compute(inputs, layout)
    (grad,) = torch.autograd.grad(loss, inputs.curr_logprobs, allow_unused=True)
    grad = torch.zeros_like(inputs.curr_logprobs) if grad is None else grad
    return -grad * float(inputs.global_valid_toks), metrics


def _x64(case: dict):
    inp = case["inputs"]
    p, g, m = (inp[k].double() for k in ("old_log_prob", "rollout_log_prob", "response_mask"))
    return p - g, m


def _close(got: float, want: float, rtol: float = 1e-5, atol: float = 1e-6) -> bool:
    return abs(got - want) <= atol + rtol * abs(want)


def test_suite_shape():
    assert len(CASES) == 41 and len(VALID) == 40 and [c["id"] for c in ERRORS] == ["case_040"]


# ---------------------------------------------------------------------------------------------------------------------
# Weights and masks
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", VALID, ids=case_ids(VALID))
def test_weights_and_mask(case):
    """The loss applies verl's rollout_is_weights (1 without IS) on the tokens of verl's modified mask, 0 elsewhere;
    the plugin's rejection marks exactly the tokens verl's rejection removes from the mask."""
    m = case["inputs"]["response_mask"]
    want_mask = case["expected"]["modified_response_mask"]
    w = case["expected"]["rollout_is_weights"]
    want = (w * want_mask) if w is not None else want_mask
    keys = plugin_keys(case["params"])
    applied, _ = applied_weights(keys, case)
    torch.testing.assert_close(applied * m, want, rtol=1e-5, atol=1e-7, msg=lambda t: f"{case['id']}: {t}")
    corr = correction(keys, case)
    torch.testing.assert_close((~corr.rejected).to(m.dtype) * m, want_mask, rtol=0, atol=0)
    if case["params"]["rollout_is_batch_normalize"] and w is not None:
        want_factor = case["expected"]["metrics"][PREFIX + "rollout_is_batch_norm_factor"]
        assert _close(float(corr.batch_norm_factor), want_factor)


@pytest.mark.parametrize("case", WITH_RS, ids=case_ids(WITH_RS))
def test_rejection_options_become_one_rule_each(case):
    params = case["params"]
    options = list(dict.fromkeys(o.strip() for o in params["rollout_rs"].split(",")))
    rules = ClippedPGLossConfig(**plugin_keys(params)).rejection_rules
    assert [r.verl_option for r in rules] == options


@pytest.mark.parametrize("case", PRESETS, ids=case_ids(PRESETS))
def test_preset_cases_are_the_presets(case):
    """The golden presets' settings are the plugin's preset table (verl's own classmethods are compared with the table
    in functional_tests/test_verl_presets.py); case 029 adds batch normalisation on top of its preset."""
    p = case["params"]
    keys = ("rollout_is", "rollout_is_threshold", "rollout_rs", "rollout_rs_threshold")
    got = preset_settings(p["preset"])
    assert {k: got[k] for k in keys} == {k: p[k] for k in keys}


@pytest.mark.parametrize("case", ERRORS, ids=case_ids(ERRORS))
def test_error_case(case):
    """verl refuses the call (case 040: a lower_upper threshold for a k2 option); so does the mapping, naming the same
    option and, for 040, giving verl's reason."""
    assert case["expected"]["error"]["raises"] == "ValueError"
    with pytest.raises(ValueError) as err:
        plugin_keys(case["params"])
    for option in re.findall(r"'(\w+)'", case["expected"]["error"]["message"]):
        if option in VERL_RS_OPTIONS:
            assert f"'{option}'" in str(err.value)
    if case["id"] == "case_040":
        assert "single upper bound without '_'" in str(err.value)


K1_CASES = [c for c in WITH_RS if any(o.strip().endswith("k1") for o in c["params"]["rollout_rs"].split(","))]


@pytest.mark.parametrize("case", K1_CASES, ids=case_ids(K1_CASES))
def test_k1_bounds_follow_verls_code_not_its_docs(case):
    """README bug 1: verl's k1 options keep log(lo) <= -log rho <= log(hi), i.e. 1/hi <= rho <= 1/lo; its docs say
    lo <= rho <= hi. The mapping reproduces the code; the documented band is the k1 rule with bounds
    [-log hi, -log lo]. The two agree for reciprocal pairs and differ on the asymmetric cases (010, 016) exactly on the
    tokens / sequences whose rho lies in one band only."""
    (rule,) = [
        r
        for r in rejection_rules(case["params"]["rollout_rs"], case["params"]["rollout_rs_threshold"])
        if r["statistic"] == "k1"
    ]
    lo, hi = math.exp(rule["min"]), math.exp(rule["max"])
    documented = dict(rule, min=-math.log(hi), max=-math.log(lo))
    verl_like = correction({"importance_sampling_rejection_rules": [rule]}, case)
    literal = correction({"importance_sampling_rejection_rules": [documented]}, case)
    x, m = _x64(case)
    stat = (
        x
        if rule["aggregation"] == "token"
        else (m * x).sum(-1, keepdim=True).expand_as(x)
        / (1.0 if rule["aggregation"] == "sequence_sum" else m.sum(-1, keepdim=True) + 1e-8)
    )
    in_code = (stat >= -math.log(hi)) & (stat <= -math.log(lo))
    in_docs = (stat >= math.log(lo)) & (stat <= math.log(hi))
    tie = torch.stack([(stat - b).abs() < 1e-6 for b in (math.log(lo), math.log(hi))]).any(0)
    settled = (m > 0) & ~tie
    assert torch.equal((~verl_like.rejected)[settled], in_code[settled])
    assert torch.equal((~literal.rejected)[settled], in_docs[settled])
    differ = (in_code != in_docs) & settled
    if math.isclose(lo * hi, 1.0, rel_tol=1e-9):
        assert not bool(differ.any())
    if case["id"] in ("case_010", "case_016"):  # the asymmetric bands of this set: the readings really differ
        assert bool(differ.any())


# ---------------------------------------------------------------------------------------------------------------------
# The shorthands seq-mis / geo-rs reproduce verl too (with the bounds inverted, README bug 1)
# ---------------------------------------------------------------------------------------------------------------------

SHORTHAND = {"seq_sum_k1": "seq-mis", "seq_mean_k1": "geo-rs"}
SINGLE_K1 = [c for c in WITH_RS if c["params"]["rollout_rs"] in SHORTHAND]


@pytest.mark.parametrize("case", SINGLE_K1, ids=case_ids(SINGLE_K1))
def test_shorthands_reproduce_verl_rejection(case):
    """importance_sampling_rejection (ratio band on pi_old / mu) with verl's bounds inverted gives verl's weights and
    masks, IS included (TIS in the truncation type, batch-normalised before the rejection as verl)."""
    params = case["params"]
    ((rule,),) = [rejection_rules(params["rollout_rs"], params["rollout_rs_threshold"])]
    keys = {k: v for k, v in plugin_keys(params).items() if k != "importance_sampling_rejection_rules"}
    keys.update(
        importance_sampling_rejection=SHORTHAND[params["rollout_rs"]],
        importance_sampling_rejection_min=math.exp(-rule["max"]),
        importance_sampling_rejection_max=math.exp(-rule["min"]),
    )
    m = case["inputs"]["response_mask"]
    w = case["expected"]["rollout_is_weights"]
    mask = case["expected"]["modified_response_mask"]
    applied, _ = applied_weights(keys, case)
    torch.testing.assert_close(applied * m, mask * (1.0 if w is None else w), rtol=1e-5, atol=1e-7)


# ---------------------------------------------------------------------------------------------------------------------
# Metrics: verl's rollout_corr/ names, and the plugin's own IS metrics
# ---------------------------------------------------------------------------------------------------------------------


def deviations(case: dict) -> dict[str, str]:
    """Metrics whose plugin value differs from verl's on purpose for this case's inputs (README 'looks like a bug').

    verl clamps log-ratios to [-20, 20] before exponentiating; the plugin does not. Only the upper clamp changes a
    value visibly: below -20 both exponentials are < exp(-40) (chi2) or < exp(-20) (weights), inside the tolerance."""
    x, m = _x64(case)
    params = case["params"]
    S = (m * x).sum(-1)
    out = {}
    if bool((x * m > 20).any()):
        out["chi2_token"] = "verl clamps token log-ratios at 20; the plugin does not"
        if params["rollout_is"] == "token":
            out["rollout_is_mean"] = out["rollout_is_max"] = "verl clamps log-ratios at 20; the plugin saturates at 30"
    if bool((S > 20).any()):
        out["chi2_seq"] = "verl clamps sequence log-ratio sums at 20; the plugin does not"
        if params["rollout_is"] == "sequence":
            out["rollout_is_mean"] = out["rollout_is_max"] = "verl clamps log-ratios at 20; the plugin saturates at 30"
    empty = m.sum(-1) == 0
    if bool(empty.any()) and params["rollout_is"] == "sequence":
        # verl's sequence extremes run over all rows, an empty one counting as S = 0 (weight 1).
        why = "verl's sequence weight extremes include the empty row (weight 1); the plugin's only valid tokens"
        if bool((S[~empty] < 0).all()):
            out.setdefault("rollout_is_max", why)
        if bool((S[~empty] > 0).all()):
            out.setdefault("rollout_is_min", why)
    return out


def test_deviation_cases_are_the_documented_ones():
    """The clamp deviations fire on exactly the README's edge cases: 036 (sequence log-ratio sum > 20), 037 (token
    log-ratio beyond +-20) and 038, whose long second row has a log-ratio sum of ~215."""
    fired = {c["id"]: sorted(deviations(c)) for c in VALID if deviations(c)}
    assert fired == {
        "case_036": ["chi2_seq", "rollout_is_max", "rollout_is_mean"],
        "case_037": ["chi2_seq", "chi2_token", "rollout_is_max", "rollout_is_mean"],
        "case_038": ["chi2_seq"],
    }, fired


def plugin_intended(case: dict, name: str) -> float:
    """The plugin's documented value of a deviating metric, computed in float64 from the inputs."""
    x, m = _x64(case)
    S = (m * x).sum(-1)
    has = m.sum(-1) > 0
    if name == "chi2_token":
        return float((m * torch.exp(2 * x)).sum() / m.sum()) - 1.0
    if name == "chi2_seq":  # verl's mean over all rows, an empty row counting exp(0); unclamped
        return float(torch.exp(2 * S)[has].sum() + (~has).sum()) / len(S) - 1.0
    log_w = x if case["params"]["rollout_is"] == "token" else S.unsqueeze(-1).expand_as(x)
    w = torch.exp(log_w.clamp(max=MAX_LOG_WEIGHT))
    return {
        "rollout_is_mean": lambda: float((m * w).sum() / m.sum()),
        "rollout_is_max": lambda: float(w[m > 0].max()),
        "rollout_is_min": lambda: float(w[m > 0].min()),
    }[name]()


def _check(case, got: dict, names) -> int:
    ref, dev, bad, checked = case["expected"]["metrics"], deviations(case), {}, 0
    for name, ours in names:
        if PREFIX + name not in ref:
            continue
        checked += 1
        want = ref[PREFIX + name]
        if name in dev:  # documented deviation: the plugin's own formula's value, and not verl's
            if not _close(got[ours], plugin_intended(case, name), rtol=1e-4) or _close(got[ours], want):
                bad[name] = (got[ours], "plugin formula", plugin_intended(case, name), "verl", want, dev[name])
        elif not _close(got[ours], want):
            bad[name] = (got[ours], want)
    assert not bad, f"{case['id']} {case['description']}: {bad}"
    return checked


@pytest.mark.parametrize("case", VALID, ids=case_ids(VALID))
def test_rollout_corr_metrics(case):
    """Every rollout_corr/ name the adapter emits is the golden value (README tolerances): the mismatch diagnostics,
    and per rejection option its statistic's mean / max / min and masked fractions, with the overall fractions."""
    keys = plugin_keys(case["params"])
    _, metrics = applied_weights(keys, case)
    m = case["inputs"]["response_mask"]
    rows, with_tokens = m.shape[0], float((m.sum(-1) > 0).sum())
    got = rollout_corr_metrics(
        metrics, ClippedPGLossConfig(**keys), rows=rows, seqs_with_tokens=with_tokens, seq_count=float(rows)
    )
    names = [(k[len(PREFIX) :], k) for k in got]
    assert _check(case, got, names) == len(got) >= 8
    if case["params"]["rollout_rs"]:
        assert PREFIX + "rollout_rs_masked_fraction" in got and PREFIX + "rollout_rs_seq_masked_fraction" in got


# The plugin's own IS-weight metrics against the golden commit's rollout_is_* (weights before truncation).
IS_METRICS = {
    "rollout_is_mean": "is_raw_weight_mean",
    "rollout_is_max": "is_raw_weight_max",
    "rollout_is_min": "is_raw_weight_min",
}
WITH_IS = [c for c in VALID if c["params"]["rollout_is"] is not None]


@pytest.mark.parametrize("case", WITH_IS, ids=case_ids(WITH_IS))
def test_raw_is_weight_metrics(case):
    _, metrics = applied_weights(plugin_keys(case["params"]), case)
    got = finalize_metrics(metrics)
    assert _check(case, {ours: got[ours] for ours in IS_METRICS.values()}, list(IS_METRICS.items())) == 3
