"""policy_objective='m2po' (loss/objectives/m2po.py) against the authors' algorithm (Infini-AI-Lab/M2PO
``verl/trainer/ppo/core_algos.py`` @ 4514ce22: ``kpo_clip_harmful_tokens`` with its sorted-breakpoint loop, then
``compute_m2po_policy_loss``) written out here in float64 Python, step by step: the clip bounds, the loss, its gradient
and the second-moment metrics, on batches where the budget binds, does not bind, and binds at the first breakpoint;
a hand-computed case; the composition with every IS level; the refusals. CP=2 and DP=2: tests/distributed/
test_m2po_parallel.py."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import get_args

import pydantic
import pytest
import torch

from nemo_is_plugin.config import ISCorrectionLevel
from nemo_is_plugin.loss import ClippedPGLoss, LossInputs
from nemo_is_plugin.loss.aggregation import aggregate
from nemo_is_plugin.loss.config_model import ClippedPGLossConfig
from nemo_is_plugin.loss.correction import compute_is_correction
from nemo_is_plugin.loss.layout import TokenLayout
from nemo_is_plugin.loss.mismatch_metrics import finalize_metrics
from nemo_is_plugin.loss.objectives.m2po import capped_sums, first_token_advantage, largest_below
from nemo_is_plugin.loss.ratios import unmasked_positions
from nemo_is_plugin.loss.separable import single_pass_blocker
from nemo_is_plugin.loss.terms import is_correction_kwargs

F64 = torch.float64
B, T = 6, 11


@dataclass
class AuthorsBounds:
    eps_low: float
    eps_high: float
    m2: float
    m2_after: float
    log_low: float  # the log-ratio bounds of the clip: log(1 - eps_low), log(1 + eps_high)
    log_high: float
    tau: float | None = None  # where the budget binds at k > 0: tau, and the (row, position) of the token setting it
    tau_token: tuple[int, int] | None = None
    tau_float32: float | None = None  # the authors' sqrt(Delta^2 - 1e-12), as their code computes it


def authors_bounds(old, new, adv, mask, budget, low_floor=None, high_floor=None) -> AuthorsBounds:
    """The authors' rule in float64 Python: harmful tokens by the row's first advantage and the ratio, M2 over them,
    the first sorted breakpoint k whose capped sum reaches the target, tau from the one before, the ratio bounds
    exp(-+tau) (or (0, 1e5)), then the floors. tau is that token's |Delta| itself: the authors take
    sqrt(Delta^2 - 1e-12) and then round exp(+-tau) to float32, which absorbs the slack (m2po.py's docstring,
    test_the_token_that_sets_tau_keeps_its_gradient); ``tau_float32`` keeps their literal value."""
    vals = []
    for i in range(old.shape[0]):
        a = float(adv[i, 0])
        for t in range(old.shape[1]):
            if mask[i, t] == 0:
                continue
            delta = float(old[i, t]) - float(new[i, t])
            r = math.exp(-delta)
            if (a > 1e-12 and r > 1 + 1e-12) or (a < -1e-12 and r < 1 - 1e-12):
                vals.append((delta * delta, abs(delta), (i, t)))
    n = len(vals)
    log_low, log_high = -math.inf, math.log(1e5)
    m2 = m2_after = 0.0
    tau = tau_token = tau_float32 = None
    if n:
        m2 = m2_after = sum(v for v, _, _ in vals) / n
        if m2 > budget + 1e-12:
            vals.sort()
            v = [x[0] for x in vals]
            csum = [sum(v[: k + 1]) for k in range(n)]
            target = budget * n
            for k in range(n):
                if (v[k] - 1e-12) * (n - k - 1) + csum[k] >= target - 1e-12:
                    if k == 0:
                        log_low, log_high, m2_after = 0.0, 0.0, csum[-1] / n
                    else:
                        tau, tau_token, tau_float32 = vals[k - 1][1], vals[k - 1][2], math.sqrt(v[k - 1] - 1e-12)
                        log_low, log_high = -tau, tau
                        m2_after = (v[k - 1] * (n - k) + csum[k - 1]) / n
                    break
    if low_floor is not None and 1 - math.exp(log_low) < low_floor:
        log_low = math.log1p(-low_floor)
    if high_floor is not None and math.exp(log_high) - 1 < high_floor:
        log_high = math.log1p(high_floor)
    eps_low, eps_high = 1 - math.exp(log_low), math.exp(log_high) - 1
    return AuthorsBounds(eps_low, eps_high, m2, m2_after, log_low, log_high, tau, tau_token, tau_float32)


def authors_per_token(old, new, adv, b: AuthorsBounds):
    """PPO's clip with those bounds: max(-A r, -A clip(r)), the ratio clipped at its log bounds. Written as its two
    branches: the clipped (constant) one only where it is strictly larger, so a token exactly on its bound (the one
    that sets tau) keeps its gradient, as m2po.py documents. ``torch.maximum`` of the two leaves that tie to autograd,
    which splits it differently across torch releases (2.13: the whole gradient; 2.15: half)."""
    log_r = new - old
    clipped = (adv > 0) & (log_r > b.log_high) | (adv < 0) & (log_r < b.log_low)
    bound = torch.exp(log_r.clamp(b.log_low, b.log_high)).detach()
    return torch.where(clipped, -adv * bound, -adv * torch.exp(log_r))


def authors_loss(old, new, adv, mask, b: AuthorsBounds):
    """Token-mean over the mask (verl's agg_loss, token-mean: sum / (count + 1e-8))."""
    return (authors_per_token(old, new, adv, b) * mask).sum() / (mask.sum() + 1e-8)


def _batch(seed: int, spread: float):
    """float64 [B, T]: per-row advantages of both signs and one 0, a masked tail and a masked interior token."""
    g = torch.Generator().manual_seed(seed)
    old = torch.log(torch.rand(B, T, generator=g, dtype=F64) * 0.9 + 0.05)
    new = (old + spread * torch.randn(B, T, generator=g, dtype=F64)).clamp(max=-1e-4)
    adv = torch.tensor([1.3, -0.7, 0.4, -2.0, 0.0, 0.9], dtype=F64)[:, None].expand(B, T).clone()
    mask = torch.ones(B, T, dtype=F64)
    mask[0, 8:] = 0
    mask[3, 4] = 0
    return old, new, adv, mask


def _run(cfg: dict, old, new, adv, mask, layout=None):
    c = new.clone().requires_grad_(True)
    inputs = LossInputs(c, old, old, None, adv, mask, torch.ones(B, dtype=F64), float(B), float(mask.sum()))
    keys = {"policy_objective": "m2po", "reference_policy_kl_penalty": 0.0, **cfg}
    loss, metrics = ClippedPGLoss(keys).compute(inputs, layout or TokenLayout.padded(B, T))
    loss.backward()
    return loss, c.grad, finalize_metrics(metrics)


CASES = {  # (seed, spread, budget, floors): the budget binds, does not bind, binds at the first breakpoint
    "binds": (0, 0.3, 0.02, (None, None)),
    "binds_with_floors": (1, 0.4, 0.01, (0.1, 0.15)),
    "under_budget": (2, 0.05, 0.5, (None, None)),
    "first_breakpoint": (3, 0.5, 1e-6, (None, None)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_bounds_loss_gradient_and_metrics_equal_the_authors_in_float64(name):
    seed, spread, budget, (low, high) = CASES[name]
    old, new, adv, mask = _batch(seed, spread)
    b = authors_bounds(old, new, adv, mask, budget, low, high)
    want_low, want_high, m2, m2_after = b.eps_low, b.eps_high, b.m2, b.m2_after
    cfg = {"m2po_budget": budget, "m2po_clip_low_floor": low, "m2po_clip_high_floor": high}
    loss, grad, metrics = _run(cfg, old, new, adv, mask)
    assert metrics["m2po_clip_low_min"] == pytest.approx(want_low, rel=1e-12, abs=1e-15)
    assert metrics["m2po_clip_high_max"] == pytest.approx(want_high, rel=1e-12, abs=1e-15)
    assert metrics["m2po_m2"] == pytest.approx(m2, rel=1e-12)
    assert metrics["m2po_m2_after"] == pytest.approx(m2_after, rel=1e-12)
    c = new.clone().requires_grad_(True)
    want = authors_loss(old, c, adv, mask, b)
    want.backward()
    torch.testing.assert_close(loss.detach(), want.detach(), rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(grad, c.grad, rtol=1e-12, atol=1e-15)
    if name == "under_budget":
        assert want_high == pytest.approx(1e5 - 1, rel=1e-15) and metrics["clip_fraction"] == 0.0
    elif name == "first_breakpoint":  # tau = 0: every harmful token is clipped at ratio 1; M2_after is M2 (as theirs)
        assert want_low == 0.0 and want_high == 0.0 and metrics["m2po_m2_after"] == pytest.approx(m2)
    else:
        assert metrics["m2po_m2_after"] <= budget and 0 < metrics["clip_fraction"] < 1


def test_hand_computed_bounds():
    """Four harmful tokens with log-ratios 0.1 .. 0.4 (A > 0, r > 1): M2 = 0.075 over a budget 0.05, target 0.2; the
    capped sums at the breakpoints 0.01, 0.04, 0.09 are 0.04, 0.13, 0.23: the first to reach 0.2 is k = 2, so
    tau = 0.2 (that token's |log r|), the bounds exp(-+0.2), M2_after = (0.04 * 2 + 0.05) / 4 = 0.0325."""
    old = torch.zeros(1, 4, dtype=F64) - 1.0
    new = old + torch.tensor([[0.1, 0.2, 0.3, 0.4]], dtype=F64)
    adv, mask = torch.ones(1, 4, dtype=F64), torch.ones(1, 4, dtype=F64)
    c = new.clone().requires_grad_(True)
    keys = {"policy_objective": "m2po", "reference_policy_kl_penalty": 0.0, "m2po_budget": 0.05}
    inputs = LossInputs(c, old, old, None, adv, mask, torch.ones(1, dtype=F64), 1.0, 4.0)
    _, metrics = ClippedPGLoss(keys).compute(inputs, TokenLayout.padded(1, 4))
    metrics = finalize_metrics(metrics)
    tau = float(new[0, 1] - old[0, 1])  # 0.2 up to the rounding of -1 + 0.2
    assert metrics["m2po_clip_high_max"] == pytest.approx(math.exp(tau) - 1, rel=1e-12)
    assert metrics["m2po_clip_low_min"] == pytest.approx(1 - math.exp(-tau), rel=1e-12)
    assert metrics["m2po_m2"] == pytest.approx(0.075, rel=1e-12)
    assert metrics["m2po_m2_after"] == pytest.approx(0.0325, rel=1e-12)
    # log r 0.3 and 0.4 lie beyond the bound; 0.2 sits on it, unclipped
    assert metrics["clip_fraction"] == pytest.approx(0.5)


@pytest.mark.parametrize("level", get_args(ISCorrectionLevel))
def test_composes_with_every_is_level(level):
    """The loss is the aggregation of w_t times M2PO's per-token loss, w the IS correction at ``level`` (truncated),
    with the bounds of the objective alone: the IS weights do not enter the statistic."""
    old, new, adv, mask = _batch(4, 0.3)
    gen = (old + 0.2 * torch.randn(B, T, generator=torch.Generator().manual_seed(9), dtype=F64)).clamp(max=-1e-4)
    is_keys = dict(
        use_importance_sampling_correction=True,
        is_correction_level=level,
        truncated_importance_sampling_type="tis",
        truncated_importance_sampling_ratio=1.5,
    )
    cfg = ClippedPGLossConfig(
        policy_objective="m2po",
        m2po_budget=0.02,
        reference_policy_kl_penalty=0.0,
        loss_aggregation="token-mean",
        **is_keys,
    )
    layout = TokenLayout.padded(B, T)
    c = new.clone().requires_grad_(True)
    sm = torch.ones(B, dtype=F64)
    loss, metrics = ClippedPGLoss(cfg).compute(
        LossInputs(c, old, gen, None, adv, mask, sm, float(B), float(mask.sum())), layout
    )
    b = authors_bounds(old, new, adv, mask, 0.02)
    assert metrics["m2po_clip_high_max"] == pytest.approx(b.eps_high, rel=1e-12)
    w = compute_is_correction(old, gen, mask, mask, layout, **is_correction_kwargs(cfg)).weights
    per = authors_per_token(old, new, adv, b)
    want = aggregate(
        w * per, mask, sm, layout, mode="token-mean", global_valid_toks=float(mask.sum()), global_valid_seqs=float(B)
    )
    torch.testing.assert_close(loss.detach(), want, rtol=1e-12, atol=1e-15)
    assert not torch.allclose(w, torch.ones_like(w))  # the weights bite


def _random_batch(seed: int, dtype: torch.dtype):
    """Values representable in ``dtype``: [B, T] log-probs moved by 0.3 randn, a random advantage per row."""
    g = torch.Generator().manual_seed(1000 + seed)
    old = torch.log(torch.rand(B, T, generator=g, dtype=F64) * 0.9 + 0.05)
    new = (old + 0.3 * torch.randn(B, T, generator=g, dtype=F64)).clamp(max=-1e-4)
    adv = torch.randn(B, generator=g, dtype=F64)[:, None].expand(B, T).clone()
    return old.to(dtype).double(), new.to(dtype).double(), adv.to(dtype).double(), torch.ones(B, T, dtype=F64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_token_that_sets_tau_keeps_its_gradient(dtype):
    """The token whose |log r| sets tau sits on the bound and keeps its gradient -A r / N, in every batch. The authors'
    tau = sqrt(Delta^2 - 1e-12) is 1e-12 short of it, but their bound goes through float32 exp, which absorbs the
    slack: their own bound leaves the token unclipped in most float32 batches (in 199 of 200 with seeds 1000..1199;
    with float64 log-probs, float32 rounding decides it in about half). Here: 30 batches of each, all with tau > 0."""
    unclipped_by_authors = 0
    for seed in range(30):
        old, new, adv, mask = _random_batch(seed, dtype)
        b = authors_bounds(old, new, adv, mask, 0.02)
        assert b.tau is not None and b.tau_token is not None and b.tau_float32 is not None
        i, t = b.tau_token
        _, grad, _ = _run({"m2po_budget": 0.02}, old.to(dtype), new.to(dtype), adv.to(dtype), mask.to(dtype))
        ratio = torch.exp((new - old).to(dtype))[i, t]
        want = float(-adv[i, t] * ratio) / (float(mask.sum()) + 1e-8)
        assert float(grad[i, t]) == pytest.approx(want, rel=1e-6 if dtype == torch.float32 else 1e-12), seed
        # the authors' literal bound: their float32 exp of their tau, then 1 -/+ (1 - lo) / (hi - 1) in Python floats
        hi = float(torch.exp(torch.tensor(+b.tau_float32)).item())
        lo = float(torch.exp(torch.tensor(-b.tau_float32)).item())
        a = float(adv[i, 0])
        unclipped_by_authors += bool(ratio <= 1 + (hi - 1)) if a > 0 else bool(ratio >= 1 - (1 - lo))
    assert unclipped_by_authors >= (25 if dtype == torch.float32 else 5), unclipped_by_authors


def test_no_harmful_token_reports_zero_second_moments_as_the_authors():
    """No harmful token (every advantage 0): the authors return M2 = M2_after = 0.0 and log them; so does the plugin,
    and the ratio is unbounded (eps_high = 1e5 - 1)."""
    old, new, _, mask = _batch(5, 0.3)
    _, grad, metrics = _run({"m2po_budget": 0.02}, old, new, torch.zeros(B, T, dtype=F64), mask)
    assert metrics["m2po_harmful_fraction"] == 0.0
    assert metrics["m2po_m2"] == 0.0 and metrics["m2po_m2_after"] == 0.0
    assert metrics["m2po_clip_high_max"] == pytest.approx(1e5 - 1, rel=1e-15)
    assert "m2po_m2" not in finalize_metrics({"loss": 1.0})  # not an m2po loss: nothing derived


def test_sequence_advantage_is_that_of_the_first_counted_token():
    """The authors read ``advantages[:, 0]``, verl's first response token; the plugin reads the first counted token
    (a row whose first positions are masked, as a prompt in NeMo-RL's layout, takes the advantage after them)."""
    adv = torch.tensor([[9.0, 9.0, -1.0, 5.0], [2.0, 3.0, 4.0, 5.0]], dtype=F64)
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 0]], dtype=F64)
    layout = TokenLayout.padded(2, 4)
    got = first_token_advantage(adv, mask, layout, unmasked_positions(mask, layout))
    assert got.tolist() == [[-1.0] * 4, [2.0] * 4]


def test_the_bit_search_finds_the_largest_value_below_the_target():
    """The largest float64 x with sum_i min(v_i, x) < target, against the closed form between two breakpoints."""
    v = torch.tensor([0.0, 0.3, 0.01, 0.09, 0.04, 0.0], dtype=F64)
    for target in (0.05, 0.2, 0.2299, 0.3, 0.4399):  # below the total 0.44 (the only targets the objective searches)
        x = float(largest_below(v, torch.tensor(target, dtype=F64), TokenLayout.padded(1, 6)))
        s = lambda y: float(capped_sums(torch.sort(v).values, torch.tensor([y], dtype=F64))[0])  # noqa: E731
        assert s(x) < target <= s(math.nextafter(x, math.inf)), (target, x)


def test_refusals_and_schedule():
    with pytest.raises(pydantic.ValidationError, match=r"m2po_budget=0 is outside its valid range \(0, inf\)"):
        ClippedPGLossConfig(policy_objective="m2po", m2po_budget=0.0)
    with pytest.raises(pydantic.ValidationError, match="ratio_clip_c configures PPO's ratio clip"):
        ClippedPGLossConfig(policy_objective="m2po", ratio_clip_c=3.0)
    with pytest.raises(pydantic.ValidationError, match="m2po_budget is read by policy_objective m2po only"):
        ClippedPGLossConfig(m2po_budget=0.1)
    with pytest.raises(pydantic.ValidationError, match="uses the token ratio"):
        ClippedPGLossConfig(policy_objective="m2po", ratio_level="sequence", token_level_loss=False)
    why = single_pass_blocker(ClippedPGLossConfig(policy_objective="m2po"), TokenLayout.padded(2, 3))
    assert why is not None and "batch" in why
    names = ClippedPGLoss({"policy_objective": "m2po"}).metric_denominators()  # the loss traced on meta tensors
    assert {"m2po_harmful_fraction", "m2po_clip_low_min", "m2po_clip_high_max"} <= set(names)


def test_derived_metrics_are_reported_with_no_harmful_token():
    """No harmful token: M2 and M2_after are 0 (no bound applied), present so every call carries the same names
    (verl's step aggregates each name over all micro-batches and refuses lists of unequal length); without M2PO's
    metrics there is nothing to derive."""
    from nemo_is_plugin.loss.objectives.m2po import M2PO

    sums = {"m2po_harmful_fraction": 0.0, "m2po_harmful_log_ratio_sq": 0.0, "m2po_capped_log_ratio_sq": 0.0}
    assert M2PO().finalize(sums) == {"m2po_m2": 0.0, "m2po_m2_after": 0.0}
    assert M2PO().finalize({"clip_fraction": 0.5}) == {}
    sums = {"m2po_harmful_fraction": 0.25, "m2po_harmful_log_ratio_sq": 0.02, "m2po_capped_log_ratio_sq": 0.01}
    assert M2PO().finalize(sums) == pytest.approx({"m2po_m2": 0.08, "m2po_m2_after": 0.04}, rel=1e-15)
