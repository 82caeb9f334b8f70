"""verl rollout-correction golden cases (tests/data/golden/verl_rollout_corr, produced by verl's
rollout_corr_helper.compute_rollout_correction_and_rejection_mask at b178a3cd): the plugin's IS weights, rejection masks
and mismatch metrics, wherever the plugin has a counterpart.

Mapping (p = old_log_prob = the plugin's prev log-probs, g = rollout_log_prob = the plugin's generation log-probs):
  rollout_is token|sequence, threshold C -> use_importance_sampling_correction, is_correction_level token|sequence,
                                            truncated_importance_sampling_type "tis", ratio C (no lower bound)
  rollout_is_batch_normalize            -> importance_sampling_batch_normalize
  rollout_rs seq_sum_k1  (Seq-MIS)      -> truncated_importance_sampling_type "seq-mis" with bounds
  rollout_rs seq_mean_k1 (Geo-RS)       -> truncated_importance_sampling_type "geo-rs" with bounds
  both (TIS + Seq-MIS / Geo-RS)         -> "tis" + importance_sampling_rejection seq-mis / geo-rs with bounds
  token_k*, seq_*_k2/k3, seq_max_k*     -> no counterpart (skipped with the reason)
verl has no sample mask: every row is a sample (sample_mask = 1, global_valid_seqs = B, global_valid_toks = #unmasked).

A verl call with both rollout_is (TIS) and a rollout_rs option is checked as two plugin configs (the weights with
"tis", the mask with the rejection type) and as the single combined config ("tis" + importance_sampling_rejection,
test_tis_plus_rejection_in_one_config).
"""

from __future__ import annotations

import math
from typing import Optional

import pytest
import torch

from golden_utils import case_ids, load_named_cases
from nemo_is_plugin.is_weights import MAX_LOG_WEIGHT
from nemo_is_plugin import build_loss_fn, finalize_metrics
from nemo_is_plugin.config import ClippedPGLossConfig
from nemo_is_plugin.correction import compute_is_correction
from nemo_is_plugin.layout import TokenLayout
from nemo_is_plugin.loss import LossInputs, is_correction_kwargs

CASES = load_named_cases("verl_rollout_corr")
VALID = [c for c in CASES if "error" not in c["expected"]]
ERRORS = [c for c in CASES if "error" in c["expected"]]
BY_ID = {c["id"]: c for c in CASES}

RS_TYPES = {"seq_sum_k1": "seq-mis", "seq_mean_k1": "geo-rs"}
PREFIX = "rollout_corr/"
# reference metric -> plugin metric (after finalize_metrics).
MISMATCH_MAP = {
    "kl": "mismatch_kl_k1",
    "k3_kl": "mismatch_kl_k3",
    "log_ppl_diff": "log_ppl_diff",
    "log_ppl_abs_diff": "log_ppl_abs_diff",
    "training_log_ppl": "training_log_ppl",
    "rollout_log_ppl": "rollout_log_ppl",
    "chi2_token": "chi2_token",
    "chi2_seq": "chi2_seq",
    "rollout_is_mean": "is_raw_weight_mean",  # weights before truncation, masked mean over tokens
    "rollout_is_max": "is_raw_weight_max",  # extremes of the weights before truncation
    "rollout_is_min": "is_raw_weight_min",
}
# No counterpart: training_ppl / rollout_ppl / ppl_ratio (means of exp), log_ppl_diff_max/min, rollout_is_std /
# _ratio_fraction_* / eff_sample_size (computed on weights clamped to [1/C, C]), rollout_is_seq_*, rollout_rs_*.


# ---------------------------------------------------------------------------------------------------------------------
# Mapping helpers
# ---------------------------------------------------------------------------------------------------------------------


def parse_rs(params: dict) -> list[tuple[str, Optional[float], float]]:
    """verl's rollout_rs / rollout_rs_threshold -> [(option, lower, upper)] (lower None for k2/k3 options)."""
    if params["rollout_rs"] is None:
        return []
    options = list(dict.fromkeys(o.strip() for o in params["rollout_rs"].split(",") if o.strip()))
    raw = params["rollout_rs_threshold"]
    if isinstance(raw, str) and "," in raw:
        thresholds = [t.strip() for t in raw.split(",")]
    else:
        thresholds = [raw] * len(options)
    out = []
    for opt, thr in zip(options, thresholds):
        if isinstance(thr, str) and "_" in thr:
            lo, hi = (float(v) for v in thr.split("_"))
        else:
            hi = float(thr)
            lo = 1.0 / hi if opt.endswith("k1") else None
        out.append((opt, lo, hi))
    return out


def unsupported_rs(params: dict) -> list[str]:
    return [opt for opt, _, _ in parse_rs(params) if opt not in RS_TYPES]


def is_config(params: dict) -> dict:
    """The TIS part: token / sequence IS weights truncated at C, optionally batch-normalised."""
    return {
        "reference_policy_kl_penalty": 0.0,
        "use_importance_sampling_correction": True,
        "is_correction_level": params["rollout_is"],
        "truncated_importance_sampling_type": "tis",
        "truncated_importance_sampling_ratio": float(params["rollout_is_threshold"]),
        "importance_sampling_batch_normalize": bool(params["rollout_is_batch_normalize"]),
    }


def rs_config(params: dict, *, literal_bounds: bool = False, with_is: bool = False) -> dict:
    """The rejection part (one mappable option). verl's k1 options test the bounds on -log rho, i.e. keep
    1/upper <= rho <= 1/lower; the plugin keeps lower <= rho <= upper, so reproducing verl's code needs the inverted
    bounds (literal_bounds=False). literal_bounds=True is the documented semantics (README bug 1)."""
    ((opt, lo, hi),) = parse_rs(params)
    low, high = (lo, hi) if literal_bounds else (1.0 / hi, 1.0 / lo)
    cfg = {
        "reference_policy_kl_penalty": 0.0,
        "truncated_importance_sampling_type": RS_TYPES[opt],
        "truncated_importance_sampling_ratio_min": low,
        "truncated_importance_sampling_ratio": high,
    }
    if with_is:
        cfg.update(
            use_importance_sampling_correction=True, is_correction_level=params["rollout_is"],
            importance_sampling_batch_normalize=bool(params["rollout_is_batch_normalize"]),
        )
    return cfg


def loss_inputs(case: dict) -> tuple[LossInputs, TokenLayout]:
    """Ratio 1 (curr = prev) and advantage 1 under token-mean: the loss is -sum_t w_t / N_tok, so
    -N_tok * d loss / d curr_t is exactly the IS weight the loss applies to token t."""
    inp = case["inputs"]
    p, g, m = inp["old_log_prob"], inp["rollout_log_prob"], inp["response_mask"]
    B, T = p.shape
    return LossInputs(
        curr_logprobs=p.clone().requires_grad_(True), prev_logprobs=p, generation_logprobs=g,
        reference_logprobs=None, advantages=torch.ones_like(p), token_mask=m, sample_mask=torch.ones(B),
        global_valid_seqs=float(B), global_valid_toks=float(m.sum()),
    ), TokenLayout.padded(B, T)


def plugin_correction(cfg_dict: dict, case: dict):
    """compute_is_correction with exactly the arguments loss.py passes for this config."""
    cfg = ClippedPGLossConfig(**cfg_dict)
    inputs, layout = loss_inputs(case)
    tm = inputs.token_mask
    valid = tm * layout.to_tokens(inputs.sample_mask)
    return compute_is_correction(
        inputs.prev_logprobs, inputs.generation_logprobs, tm, valid, layout, **is_correction_kwargs(cfg)
    )


def combined_config(params: dict) -> dict:
    """verl's TIS + Seq-MIS / Geo-RS preset as one plugin config: the TIS part (is_config) plus the rejection in
    importance_sampling_rejection, with rs_config's inverted k1 bounds."""
    ((opt, lo, hi),) = parse_rs(params)
    cfg = is_config(params)
    cfg.update(importance_sampling_rejection=RS_TYPES[opt], importance_sampling_rejection_min=1.0 / hi,
               importance_sampling_rejection_max=1.0 / lo)
    return cfg


def applied_weights(cfg_dict: dict, case: dict):
    """(weights the loss applies per token, finalized metrics) from a real loss call (see loss_inputs)."""
    inputs, layout = loss_inputs(case)
    loss, metrics = build_loss_fn(cfg_dict).compute(inputs, layout)
    (grad,) = torch.autograd.grad(loss, inputs.curr_logprobs, allow_unused=True)
    grad = torch.zeros_like(inputs.curr_logprobs) if grad is None else grad
    return -grad * float(inputs.global_valid_toks), finalize_metrics(metrics)


def metric_config(params: dict) -> dict:
    if params["rollout_is"] is not None:
        return is_config(params)
    return {"reference_policy_kl_penalty": 0.0}


def _close(got: float, want: float, rtol: float = 1e-5, atol: float = 1e-6) -> bool:
    return abs(got - want) <= atol + rtol * abs(want)


def _x64(case: dict):
    inp = case["inputs"]
    p, g, m = (inp[k].double() for k in ("old_log_prob", "rollout_log_prob", "response_mask"))
    return p - g, m


def _ids(cases):
    return case_ids(cases)


WITH_IS = [c for c in VALID if c["params"]["rollout_is"] is not None]
WITH_RS = [c for c in VALID if c["params"]["rollout_rs"] is not None]
COMBINED = [c for c in WITH_IS if c["params"]["rollout_rs"] is not None and not unsupported_rs(c["params"])]


# ---------------------------------------------------------------------------------------------------------------------
# IS weights
# ---------------------------------------------------------------------------------------------------------------------


def test_suite_shape():
    assert len(CASES) == 41 and len(VALID) == 40 and [c["id"] for c in ERRORS] == ["case_040"]


@pytest.mark.parametrize("case", WITH_IS, ids=_ids(WITH_IS))
def test_is_weights(case):
    """verl's weights do not depend on rollout_rs (rejection only modifies the mask), so the TIS config alone must
    reproduce rollout_is_weights * mask: from compute_is_correction and as the weights the loss actually applies."""
    params = case["params"]
    m = case["inputs"]["response_mask"]
    want = case["expected"]["rollout_is_weights"] * m
    cfg = is_config(params)
    corr = plugin_correction(cfg, case)
    torch.testing.assert_close(corr.weights * m, want, rtol=1e-5, atol=1e-7)
    applied, _ = applied_weights(cfg, case)
    torch.testing.assert_close(applied * m, want, rtol=1e-5, atol=1e-7)
    key = PREFIX + "rollout_is_batch_norm_factor"
    if params["rollout_is_batch_normalize"]:
        assert _close(float(corr.batch_norm_factor), case["expected"]["metrics"][key])
    else:
        assert key not in case["expected"]["metrics"] and float(corr.batch_norm_factor) == 1.0


# ---------------------------------------------------------------------------------------------------------------------
# Rejection masks
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", WITH_RS, ids=_ids(WITH_RS))
def test_rejection_mask(case):
    params = case["params"]
    missing = unsupported_rs(params)
    if missing:
        pytest.skip(f"rollout_rs option(s) {missing} have no plugin counterpart (only seq_sum_k1 -> seq-mis and "
                    "seq_mean_k1 -> geo-rs)")
    m = case["inputs"]["response_mask"]
    want = case["expected"]["modified_response_mask"]
    cfg = rs_config(params)
    corr = plugin_correction(cfg, case)
    torch.testing.assert_close((~corr.rejected).to(m.dtype) * m, want, rtol=0, atol=0)
    # Without rollout_is the loss applies weight 1 on kept tokens and 0 on rejected ones: exactly the modified mask.
    applied, _ = applied_weights(cfg, case)
    torch.testing.assert_close(applied * m, want, rtol=0, atol=1e-7)


@pytest.mark.parametrize("case", WITH_RS, ids=_ids(WITH_RS))
def test_k1_bounds_literal_semantics(case):
    """README bug 1: verl's k1 options keep 1/upper <= rho <= 1/lower (bounds applied to -log rho); the plugin, given
    the bounds as written, keeps lower <= rho <= upper (the documented semantics). Both give the same mask for
    reciprocal pairs; for asymmetric ones (case 016, '0.99_1.02') they differ exactly on the rows whose rho lies
    in one band but not the other."""
    params = case["params"]
    if unsupported_rs(params):
        pytest.skip(f"rollout_rs option(s) {unsupported_rs(params)} have no plugin counterpart")
    ((opt, lo, hi),) = parse_rs(params)
    m = case["inputs"]["response_mask"]
    want = case["expected"]["modified_response_mask"]
    corr = plugin_correction(rs_config(params, literal_bounds=True), case)
    got = (~corr.rejected).to(m.dtype) * m
    x, m64 = _x64(case)
    n = m64.sum(-1)
    log_rho = (m64 * x).sum(-1) / (1.0 if opt == "seq_sum_k1" else (n + 1e-8))
    literal = (log_rho >= math.log(lo)) & (log_rho <= math.log(hi))
    inverted = (log_rho >= -math.log(hi)) & (log_rho <= -math.log(lo))
    # Rows within 1e-6 of a bound are float32-vs-float64 ties: leave those to the exact test above.
    tie = torch.stack([(log_rho - b).abs() < 1e-6 for b in (math.log(lo), math.log(hi), -math.log(lo), -math.log(hi))])
    settled = ~tie.any(0) & (n > 0)
    assert torch.equal(got.amax(-1)[settled] > 0, literal[settled])
    assert torch.equal(want.amax(-1)[settled] > 0, inverted[settled])
    differ = settled & (literal != inverted)
    assert torch.equal((got != want).any(-1) & settled, differ)
    if case["id"] == "case_016":
        assert bool(differ.any()), "case 016 is the asymmetric-bounds case: the two readings must differ on it"
    if math.isclose(lo * hi, 1.0, rel_tol=1e-12):
        assert not bool(differ.any())


TOKEN_K1 = [c for c in WITH_RS if [o for o, _, _ in parse_rs(c["params"])] == ["token_k1"]]


@pytest.mark.parametrize("case", TOKEN_K1, ids=_ids(TOKEN_K1))
def test_token_k1_mask_as_icepop(case):
    """token_k1 (skipped above: not in the brief's mapping) does have a partial counterpart: the plugin's token-level
    IcePop band 1[low <= exp(p_t - g_t) <= high] rejects the same tokens, with verl's k1 bounds inverted (README bug 1).
    Partial only: icepop is a truncation type that also applies the token IS weights (it needs
    use_importance_sampling_correction), while verl's token_k1 alone only masks; so only the mask is compared."""
    ((_, lo, hi),) = parse_rs(case["params"])
    cfg = {
        "reference_policy_kl_penalty": 0.0, "use_importance_sampling_correction": True, "is_correction_level": "token",
        "truncated_importance_sampling_type": "icepop",
        "truncated_importance_sampling_ratio_min": 1.0 / hi, "truncated_importance_sampling_ratio": 1.0 / lo,
    }
    m = case["inputs"]["response_mask"]
    corr = plugin_correction(cfg, case)
    torch.testing.assert_close((~corr.rejected).to(m.dtype) * m, case["expected"]["modified_response_mask"],
                               rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------------------------------
# IS + rejection in one plugin config
# ---------------------------------------------------------------------------------------------------------------------


def _cap_binds_on_kept_tokens(case: dict) -> bool:
    x, m = _x64(case)
    log_w = x if case["params"]["rollout_is"] == "token" else (m * x).sum(-1, keepdim=True).expand_as(x)
    kept = case["expected"]["modified_response_mask"] > 0
    return bool((log_w[kept] > math.log(case["params"]["rollout_is_threshold"])).any())


@pytest.mark.parametrize("case", COMBINED, ids=_ids(COMBINED))
def test_tis_plus_rejection_in_one_config(case):
    """verl's Seq-MIS / Geo-RS + TIS presets as one plugin config (TIS in truncated_importance_sampling_type, the
    rejection in importance_sampling_rejection): the weights the loss applies equal verl's min(w, C), batch-normalised
    before the rejection, times its modified mask, and the rejected-token fraction equals verl's mask change."""
    m = case["inputs"]["response_mask"]
    want = case["expected"]["rollout_is_weights"] * case["expected"]["modified_response_mask"]
    applied, metrics = applied_weights(combined_config(case["params"]), case)
    torch.testing.assert_close(applied * m, want, rtol=1e-5, atol=1e-7, msg=lambda text: f"{case['id']}: {text}")
    rejected = ((m > 0) & (case["expected"]["modified_response_mask"] == 0)).double().sum() / m.sum()
    assert metrics["is_rejected_fraction"] == pytest.approx(rejected.item(), rel=1e-8)  # metrics divide by N + 1e-8


@pytest.mark.parametrize("case", COMBINED, ids=_ids(COMBINED))
def test_combined_is_and_rejection_config(case):
    """The rejection as the truncation type with the IS level (no TIS cap): the loss applies raw weights * keep, then
    batch normalisation if asked. In these cases no kept token has a weight above C (for Seq-MIS with bounds [1/C, C]
    that holds by construction; for Geo-RS + TIS it is a property of the data), so it must agree with verl's capped
    weights too; test_tis_plus_rejection_in_one_config is the config that needs no such property."""
    params = case["params"]
    m = case["inputs"]["response_mask"]
    assert not _cap_binds_on_kept_tokens(case)
    want = case["expected"]["rollout_is_weights"] * case["expected"]["modified_response_mask"]
    applied, _ = applied_weights(rs_config(params, with_is=True), case)
    torch.testing.assert_close(
        applied * m, want, rtol=1e-5, atol=1e-7,
        msg=lambda text: f"{case['id']} {case['description']}: {text}\n(batch normalisation: verl divides by the mean "
        "of the truncated weights before rejection; the plugin divides the final, rejection-masked weights)",
    )


COMBINED_BN = [c for c in COMBINED if c["params"]["rollout_is_batch_normalize"]]


@pytest.mark.parametrize("case", COMBINED_BN, ids=_ids(COMBINED_BN))
def test_combined_config_agrees_before_batch_normalisation(case):
    """Isolates the batch-normalisation order in the combined config: without normalisation the plugin's weights equal
    verl's truncated weights (rollout_is_weights * verl's batch_norm_factor) on kept tokens. verl normalises before
    rejection (divisor: mean over rows of the truncated weights, rejected rows included with their weights); the
    plugin divides the final weights, rejected rows counted as 0 (correction.py / docs/config.md)."""
    params = case["params"]
    m = case["inputs"]["response_mask"]
    factor = case["expected"]["metrics"][PREFIX + "rollout_is_batch_norm_factor"]
    want = case["expected"]["rollout_is_weights"] * factor * case["expected"]["modified_response_mask"]
    cfg = rs_config(params, with_is=True)
    cfg["importance_sampling_batch_normalize"] = False
    applied, _ = applied_weights(cfg, case)
    torch.testing.assert_close(applied * m, want, rtol=1e-5, atol=1e-7)


# ---------------------------------------------------------------------------------------------------------------------
# Mismatch metrics
# ---------------------------------------------------------------------------------------------------------------------


def deviations(case: dict) -> dict[str, str]:
    """Metrics whose plugin value differs from verl's on purpose for this case's inputs (README 'looks like a bug').

    verl clamps log-ratios to [-20, 20] before exponentiating; the plugin does not. Only the upper clamp changes a
    value visibly: below -20 both exponentials are < exp(-40) (chi2) or < exp(-20) (weights), inside the tolerance,
    so cases with large negative log-ratios (027, 037, 038) are still compared strictly there."""
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
    if bool(empty.any()):
        out.setdefault("chi2_seq", "verl counts an empty row as exp(0) - 1; the plugin leaves it out of the sum")
        if params["rollout_is"] == "sequence":
            # verl's sequence extremes run over all rows, an empty one counting as S = 0 (weight 1).
            why = "verl's sequence weight extremes include the empty row (weight 1); the plugin's only valid tokens"
            if bool((S[~empty] < 0).all()):
                out.setdefault("rollout_is_max", why)
            if bool((S[~empty] > 0).all()):
                out.setdefault("rollout_is_min", why)
    return out


def plugin_intended(case: dict, name: str) -> float:
    """The plugin's documented value (diagnostics.py), computed in float64 from the inputs."""
    x, m = _x64(case)
    B = x.shape[0]
    n_tok = float(m.sum())
    S = (m * x).sum(-1)
    has = m.sum(-1) > 0
    if name == "chi2_token":
        return float((m * torch.exp(2 * x)).sum()) / n_tok - 1.0
    if name == "chi2_seq":  # E_seq over global_valid_seqs = B of exp(2 S), rows without tokens left out of the sum
        return float(torch.exp(2 * S)[has].sum()) / B - 1.0
    # Explicit IS levels saturate log w at MAX_LOG_WEIGHT (30); verl clamps at 20.
    log_w = x if case["params"]["rollout_is"] == "token" else S.unsqueeze(-1).expand_as(x)
    w = torch.exp(log_w.clamp(max=MAX_LOG_WEIGHT))
    if name == "rollout_is_mean":
        return float((m * w).sum()) / n_tok
    if name == "rollout_is_max":
        return float(w[m > 0].max())
    if name == "rollout_is_min":
        return float(w[m > 0].min())
    raise KeyError(name)


@pytest.mark.parametrize("case", VALID, ids=_ids(VALID))
def test_mismatch_metrics(case):
    _, metrics = applied_weights(metric_config(case["params"]), case)
    ref = case["expected"]["metrics"]
    dev = deviations(case)
    bad, checked = {}, 0
    for ref_name, key in MISMATCH_MAP.items():
        if PREFIX + ref_name not in ref:
            continue
        want, got = ref[PREFIX + ref_name], metrics[key]
        checked += 1
        if ref_name in dev:
            # Documented deviation: the plugin gives its own formula's value, and it is not verl's.
            intended = plugin_intended(case, ref_name)
            if not _close(got, intended, rtol=1e-4) or _close(got, want):
                bad[ref_name] = (key, got, "plugin formula", intended, "verl", want, dev[ref_name])
        elif not _close(got, want):
            bad[ref_name] = (key, got, want)
    assert checked >= 8
    assert not bad, f"{case['id']} {case['description']}: {bad}"


def test_deviation_cases_are_the_documented_ones():
    """The clamp and empty-row deviations fire on exactly the README's edge cases: 035 (fully masked row), 036
    (sequence log-ratio sum > 20), 037 (token log-ratio beyond +-20), and on 038, whose long second row has a
    log-ratio sum of ~215: its chi2_seq is exp(40)-scale in verl and ~1e186 in the plugin (unclamped)."""
    fired = {c["id"]: sorted(deviations(c)) for c in VALID if deviations(c)}
    assert fired == {
        "case_035": ["chi2_seq"],
        "case_036": ["chi2_seq", "rollout_is_max", "rollout_is_mean"],
        "case_037": ["chi2_seq", "chi2_token", "rollout_is_max", "rollout_is_mean"],
        "case_038": ["chi2_seq"],
    }, fired


def test_empty_row_chi2_seq_offset():
    """README bug 2 (case 035): verl's chi2_seq averages exp(2 S_b) - 1 over all B rows, so an empty row adds
    exp(0) - 1 = 0 and the mean of exp(2 S_b) includes a 1 for it; the plugin's E_seq[exp(2 S)] leaves the empty row
    out of the sum (same denominator B). The two differ by exactly (#empty rows) / B."""
    case = BY_ID["case_035"]
    m = case["inputs"]["response_mask"]
    empty = int((m.sum(-1) == 0).sum())
    assert empty == 1
    _, metrics = applied_weights(metric_config(case["params"]), case)
    want = case["expected"]["metrics"][PREFIX + "chi2_seq"]
    assert _close(metrics["chi2_seq"], want - empty / m.shape[0])
    # The per-row log-ppl metrics agree: both count the empty row as 0 over B rows.
    for name in ("training_log_ppl", "rollout_log_ppl", "log_ppl_diff", "log_ppl_abs_diff"):
        assert _close(metrics[name], case["expected"]["metrics"][PREFIX + name]), name


@pytest.mark.parametrize("case", ERRORS, ids=_ids(ERRORS))
def test_error_case(case):
    params = case["params"]
    assert case["expected"]["error"]["raises"] == "ValueError"
    pytest.skip(f"reference rejects a lower_upper threshold for {params['rollout_rs']!r}; that option has no plugin "
                "counterpart (k2 statistics are not a plugin rejection type)")
