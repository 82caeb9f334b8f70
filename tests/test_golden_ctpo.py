"""CTPO golden cases (tests/data/golden/ctpo, produced by CTPO's verl fork, core_algos.py at acc40211): the plugin's
cumulative ratio levels + log-space / ratio-space clip reproduce pg_loss, d pg_loss / d log_prob and every clip /
ratio metric that has a counterpart.

Mapping (README "What is computed"):
  cum-token-cumprod(-la)  -> ratio_level "cumulative";  cum-token-geomean(-la) -> "cumulative_mean"
  clamp(d, -20, 20)       -> token_log_ratio_clamp 20;  min(., 10) -> max_log_ratio 10
  LA                      -> log_ratio_clip_low/high/c = la_clip_low/high/c, clip_position_power = clip_ratio_la_power
                             (p0_workaround cases were produced with p = 1e-30; the plugin is given the nominal 0.0)
  non-LA                  -> ratio_clip_min/max = clip_ratio_low/high, ratio_clip_c = clip_ratio_c
  loss_agg_mode           -> loss_aggregation; token-mean: global_valid_toks = #unmasked tokens;
                             seq-mean-*: sample_mask = rows with >= 1 unmasked token, global_valid_seqs = their count
  rollout_is_weights w    -> token IS correction with generation log-probs g = old - log w (so exp(p - g) = w)
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers.golden_ctpo import ctpo_config, ctpo_inputs, is_la, loss_rtol
from helpers.golden_utils import case_ids, load_named_cases

from nemo_is_plugin import build_loss_fn, finalize_metrics
from nemo_is_plugin.loss.objectives.ppo_clip import log_space_clip_surrogate

CASES = load_named_cases("ctpo")
VALID = [c for c in CASES if "error" not in c["expected"]]
ERRORS = [c for c in CASES if "error" in c["expected"]]
BY_ID = {c["id"]: c for c in CASES}

# reference metric -> plugin metric (rates are token means over the unmasked tokens in both).
METRIC_MAP = {
    "actor/pg_clipfrac": "clip_fraction",
    "actor/pg_clipfrac_lower": "clip_fraction_dual",
    "pg_update/clip/high/rate": "clip_fraction_high",
    "pg_update/clip/low/rate": "clip_fraction_low",
    "pg_update/clip/dual/rate": "clip_fraction_dual",
    "pg_update/is_ratio/mean": "probs_ratio",
    "pg_update/is_ratio/min": "probs_ratio_min",
    "pg_update/is_ratio/max": "probs_ratio_max",
}
# reference count -> plugin rate (count = rate * #unmasked, compared exactly).
COUNT_MAP = {
    "pg_update/clip/high/count": "clip_fraction_high",
    "pg_update/clip/low/count": "clip_fraction_low",
    "pg_update/clip/dual/count": "clip_fraction_dual",
}
# No counterpart in the plugin: actor/ppo_kl (KL(current || old); the plugin's mismatch metrics are old vs rollout),
# the is_ratio quantiles p25..p99, neg_adv_token_count and the LA-only pg_update/la_* diagnostics.


def run_plugin(case: dict, dtype=torch.float32, power: float | None = None):
    inputs, layout = ctpo_inputs(case, dtype)
    loss, metrics = build_loss_fn(ctpo_config(case["params"], power)).compute(inputs, layout)
    (grad,) = torch.autograd.grad(loss, inputs.curr_logprobs, allow_unused=True)
    grad = torch.zeros_like(inputs.curr_logprobs) if grad is None else grad
    return loss.detach(), grad, finalize_metrics(metrics), inputs


def _close(got: float, want: float, rtol: float = 1e-5, atol: float = 1e-6) -> bool:
    return abs(got - want) <= atol + rtol * abs(want)


# ---------------------------------------------------------------------------------------------------------------------
# The golden cases
# ---------------------------------------------------------------------------------------------------------------------


def test_suite_shape():
    assert len(CASES) == 44 and len(VALID) == 42 and [c["id"] for c in ERRORS] == ["case_042", "case_043"]


@pytest.mark.parametrize("case", VALID, ids=case_ids(VALID))
def test_loss_and_gradient(case):
    loss, grad, _, inputs = run_plugin(case)
    want = case["expected"]
    rtol = loss_rtol(case)
    torch.testing.assert_close(loss, want["pg_loss"].to(loss.dtype), rtol=rtol, atol=1e-6)
    torch.testing.assert_close(grad, want["grad_log_prob"].to(grad.dtype), rtol=rtol, atol=1e-6)
    # Masked positions hold arbitrary log-probs on purpose: nothing may leak into them.
    assert bool((grad[inputs.token_mask == 0] == 0).all())


@pytest.mark.parametrize("case", VALID, ids=case_ids(VALID))
def test_metrics(case):
    _, _, metrics, inputs = run_plugin(case)
    ref = case["expected"]["metrics"]
    n_tok = float(inputs.token_mask.sum())
    assert ref["pg_update/clip/valid_token_count"] == n_tok
    bad = {}
    for ref_key, key in METRIC_MAP.items():
        if not _close(metrics[key], ref[ref_key]):
            bad[ref_key] = (key, metrics[key], ref[ref_key])
    for ref_key, key in COUNT_MAP.items():  # counts: exact
        count = metrics[key] * n_tok
        if round(count) != ref[ref_key] or abs(count - round(count)) > 1e-4:
            bad[ref_key] = (key, count, ref[ref_key])
    # total = union of high / low / dual clipping; the plugin's clip-by-position buckets count exactly that union
    # (clipped | dual_clipped), and the buckets partition the unmasked tokens.
    total = sum(v for k, v in metrics.items() if k.startswith("clip_frac/pos_"))
    if not _close(total, ref["pg_update/clip/total/rate"]) or round(total * n_tok) != ref["pg_update/clip/total/count"]:
        bad["pg_update/clip/total/rate"] = ("sum clip_frac/pos_*", total, ref["pg_update/clip/total/rate"])
    assert _close(sum(v for k, v in metrics.items() if k.startswith("token_frac/pos_")), 1.0)
    assert not bad, f"{case['id']} {case['description']}: (plugin key, got, want): {bad}"


@pytest.mark.parametrize(
    "case",
    [c for c in VALID if c["params"]["uses_rollout_is_weights"]],
    ids=case_ids([c for c in VALID if c["params"]["uses_rollout_is_weights"]]),
)
def test_rollout_is_weights_are_applied_as_given(case):
    """The mapping g = old - log w hands the plugin exactly the reference's weights (no truncation configured)."""
    _, _, metrics, inputs = run_plugin(case)
    m = inputs.token_mask
    w = case["inputs"]["rollout_is_weights"].double()
    n = float(m.sum())
    assert _close(metrics["is_weight_mean"], float((w * m).sum()) / n)
    assert _close(metrics["is_weight_min"], float(w[m > 0].min()))
    assert _close(metrics["is_weight_max"], float(w[m > 0].max()))


# ---------------------------------------------------------------------------------------------------------------------
# Reference bug 1 (cases 042 / 043): LA with clip_ratio_la_power = 0.0 crashes in the reference (TypeError from
# torch.exp on a Python float). The plugin handles p = 0 (fixed bounds): these tests check it against the README's
# formulas, re-implemented below in float64, since the reference itself produced no numbers for these inputs.
# ---------------------------------------------------------------------------------------------------------------------


def reference_formulas(case: dict, power: float | None = None):
    """README steps 1-7 in float64 (independent of the plugin): returns (pg_loss, d pg_loss / d log_prob)."""
    params, inp = case["params"], case["inputs"]
    ref = params["config"]
    old = inp["old_log_prob"].double()
    lp = inp["log_prob"].double().clone().requires_grad_(True)
    A, m = inp["advantages"].double(), inp["response_mask"].double()
    w = inp["rollout_is_weights"]
    w = torch.ones_like(m) if w is None else w.double()
    d = (lp - old).clamp(-20, 20)
    S, n = torch.cumsum(m * d, -1), torch.cumsum(m, -1)
    k = S if params["ratio_mode"] == "cumprod" else S / n.clamp(min=1)
    k = torch.where(m > 0, k, torch.zeros_like(k)).detach()
    log_r = torch.clamp(k + lp - lp.detach(), max=10.0)
    r = torch.where(m > 0, torch.exp(log_r), torch.zeros_like(log_r))
    if is_la(params):
        p = ref["clip_ratio_la_power"] if power is None else power
        s = n.clamp(min=1) ** p
        rc = torch.exp(torch.minimum(torch.maximum(log_r, -ref["la_clip_low"] * s), ref["la_clip_high"] * s))
        rc = torch.where(m > 0, rc, torch.zeros_like(rc))
        c = torch.where(m > 0, torch.exp(ref["la_clip_c"] * s), torch.zeros_like(s))
    else:
        rc = r.clamp(1 - ref["clip_ratio_low"], 1 + ref["clip_ratio_high"])
        c = torch.full_like(r, ref["clip_ratio_c"])
    L1, L2, L3 = -A * r, -A * rc, -A * c
    Lc = torch.maximum(L1, L2)
    tok = torch.where(A < 0, torch.minimum(L3, Lc), Lc) * w
    agg = params["loss_agg_mode"]
    if agg == "token-mean":
        loss = (m * tok).sum() / m.sum().clamp(min=1)
    else:
        rows = m.sum(-1) > 0
        per = (m * tok).sum(-1)
        if agg == "seq-mean-token-mean":
            per = per / (m.sum(-1) + 1e-8)
        loss = per[rows].mean()
    (grad,) = torch.autograd.grad(loss, lp)
    return loss.detach(), grad


@pytest.mark.parametrize("case", VALID, ids=case_ids(VALID))
def test_reference_formulas_reproduce_golden(case):
    """Keeps the float64 re-implementation used for cases 042 / 043 honest: it must reproduce every golden case."""
    loss, grad = reference_formulas(case, power=0.0 if case["params"].get("p0_workaround") else None)
    rtol = loss_rtol(case)
    torch.testing.assert_close(loss, case["expected"]["pg_loss"].double(), rtol=rtol, atol=1e-6)
    torch.testing.assert_close(grad, case["expected"]["grad_log_prob"].double(), rtol=rtol, atol=1e-6)


@pytest.mark.parametrize("case", ERRORS, ids=case_ids(ERRORS))
def test_power_zero_reference_crash_is_handled(case):
    """Reference bug: CTPO-LA with clip_ratio_la_power = 0.0 raises TypeError (exp() of a Python float). The plugin
    accepts p = 0 (uniform log-space window [e^-low, e^high], dual clip e^c) and computes the intended loss."""
    assert case["expected"]["error"]["raises"] == "TypeError"
    assert case["params"]["config"]["clip_ratio_la_power"] == 0.0 and is_la(case["params"])
    loss, grad, metrics, _ = run_plugin(case)
    assert ctpo_config(case["params"])["clip_position_power"] == 0.0
    assert math.isfinite(float(loss)) and bool(torch.isfinite(grad).all())
    want_loss, want_grad = reference_formulas(case, power=0.0)
    torch.testing.assert_close(loss.double(), want_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad.double(), want_grad, rtol=1e-5, atol=1e-6)
    # p = 0 equals the reference's own workaround p = 1e-30 (t^p == 1 in float32) exactly.
    loss_eps, grad_eps, metrics_eps, _ = run_plugin(case, power=1e-30)
    assert float(loss) == float(loss_eps) and torch.equal(grad, grad_eps)
    for key in set(METRIC_MAP.values()):
        assert metrics[key] == metrics_eps[key], key


# ---------------------------------------------------------------------------------------------------------------------
# README "bugs" 2-4: the plugin reproduces the reference (the goldens above pass); these tests pin the behaviour down.
# ---------------------------------------------------------------------------------------------------------------------


def test_la_power_zero_is_not_the_ratio_space_clip():
    """Bug 2: LA p = 0 is a log-space window [e^-low, e^high] with dual clip e^c, not [1 - low, 1 + high] with c, so
    cases 040 (LA, low = high = 0.2, c = ln 3) and 041 (ratio space 0.2 / 0.2, c = 3) differ, in the reference and in
    the plugin alike."""
    la, plain = BY_ID["case_040"], BY_ID["case_041"]
    for key in ("old_log_prob", "log_prob", "advantages", "response_mask"):
        assert torch.equal(la["inputs"][key], plain["inputs"][key])
    assert la["expected"]["pg_loss"] != plain["expected"]["pg_loss"]
    loss_la, grad_la, _, _ = run_plugin(la)
    loss_plain, grad_plain, _, _ = run_plugin(plain)
    torch.testing.assert_close(loss_la, la["expected"]["pg_loss"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(loss_plain, plain["expected"]["pg_loss"], rtol=1e-5, atol=1e-6)
    assert abs(float(loss_la) - float(loss_plain)) > 1e-4
    assert not torch.allclose(grad_la, grad_plain)
    # The windows themselves: e^-0.2 = 0.8187 vs 0.8, e^0.2 = 1.2214 vs 1.2; dual e^{ln 3} = 3 = c.
    out = log_space_clip_surrogate(
        torch.log(torch.tensor([0.5, 2.0, 5.0])),
        torch.tensor([1.0, 1.0, -1.0]),
        torch.ones(3),
        eps_low=0.2,
        eps_high=0.2,
        eps_c=math.log(3.0),
        power=0.0,
    )
    torch.testing.assert_close(out.clipped_ratio[:2], torch.tensor([math.exp(-0.2), math.exp(0.2)]))
    torch.testing.assert_close(out.loss[2], torch.tensor(3.0))


def test_default_dual_clip_coincides_with_upper_window_edge():
    """Bug 3: with the defaults la_clip_c = la_clip_high = 0.05, every A < 0 token with log r > 0.05 * s_t is capped at
    -A e^{0.05 s_t} with zero gradient and counted as 'dual' (not 'high', which needs A > 0). Case 037 (all A < 0,
    defaults) is dual-clip heavy in the reference; the plugin agrees token by token."""
    case = BY_ID["case_037"]
    params = case["params"]
    assert params["config"]["la_clip_c"] == params["config"]["la_clip_high"] == 0.05
    loss, grad, metrics, inputs = run_plugin(case)
    m, A = inputs.token_mask, inputs.advantages
    assert bool((A[m > 0] < 0).all())
    ref = case["expected"]["metrics"]
    assert ref["pg_update/clip/dual/count"] > 0 and ref["pg_update/clip/high/count"] == 0
    assert metrics["clip_fraction_high"] == 0.0
    assert round(metrics["clip_fraction_dual"] * float(m.sum())) == ref["pg_update/clip/dual/count"]
    # Tokens above the upper edge carry no gradient in both implementations.
    old, lp = case["inputs"]["old_log_prob"].double(), case["inputs"]["log_prob"].double()
    n = torch.cumsum(m.double(), -1).clamp(min=1)
    k = torch.cumsum(m.double() * (lp - old).clamp(-20, 20), -1)
    above = (m > 0) & (k > 0.05 * n ** params["config"]["clip_ratio_la_power"] + 1e-4)
    assert bool(above.any())
    assert bool((grad[above] == 0).all()) and bool((case["expected"]["grad_log_prob"][above] == 0).all())


def test_stale_launch_comment_lower_bound():
    """Bug 4: at t = 100 with p = 0.5 and la_clip_low = 0.025 the lower bound is e^{-0.25} = 0.779, not 0.74 (which
    would need low = 0.03); the upper bound is e^{0.5} = 1.65 as the comment says."""
    t = torch.tensor([100.0, 100.0])
    out = log_space_clip_surrogate(
        torch.log(torch.tensor([0.01, 100.0])),
        torch.tensor([-1.0, 1.0]),
        t,
        eps_low=0.025,
        eps_high=0.05,
        eps_c=None,
        power=0.5,
    )
    torch.testing.assert_close(out.clipped_ratio, torch.tensor([math.exp(-0.25), math.exp(0.5)]))
    assert abs(float(out.clipped_ratio[0]) - 0.74) > 0.03 and abs(float(out.clipped_ratio[1]) - 1.65) < 0.01
