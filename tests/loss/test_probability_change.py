"""p - q written once (loss/ratios.py): hand values, its one dtype (at least float32) and NaN rule (a NaN or +inf
log-prob counts 0), and every reader of |p - q| (prob_diff's and DPPO's Binary-TV masks, CPPO's divergence, the
prob_diff rejection rule) reading exactly it; CPPO's move-toward-the-anchor test reads the surrogate's own clamped
ratio (``token_log_ratio_clamp``), not a literal 20."""

from __future__ import annotations

import math

import torch

from nemo_is_plugin.config import RejectionRule
from nemo_is_plugin.loss.config_model import ClippedPGLossConfig
from nemo_is_plugin.loss.layout import TokenLayout
from nemo_is_plugin.loss.objectives import objective_of
from nemo_is_plugin.loss.objectives.base import ObjectiveInputs
from nemo_is_plugin.loss.objectives.cppo import cppo_mask
from nemo_is_plugin.loss.objectives.dppo import binary_tv_mask
from nemo_is_plugin.loss.objectives.prob_diff import probability_difference_mask
from nemo_is_plugin.loss.ratios import probability_change, probability_difference, unmasked_positions
from nemo_is_plugin.loss.rejection import evaluate_rule

F64 = torch.float64
INF, NAN = math.inf, math.nan


def test_hand_values_and_the_non_finite_rule():
    p = torch.tensor([0.5, 0.2, 0.9, 0.4, 0.0, 0.3, 0.3], dtype=F64)
    q = torch.tensor([0.3, 0.25, 0.0, 0.4, 0.0, 0.3, 0.3], dtype=F64)
    c, a = p.log(), q.log()
    c[5], a[6] = NAN, INF  # no probability: the change counts 0
    got = probability_change(c, a)
    assert got.dtype == F64
    torch.testing.assert_close(got, torch.tensor([0.2, -0.05, 0.9, 0.0, 0.0, 0.0, 0.0], dtype=F64), rtol=0, atol=1e-15)
    assert torch.equal(probability_difference(c, a), got.abs())


def test_at_least_float32_whatever_the_input_dtype():
    g = torch.Generator().manual_seed(3)
    a = torch.log(torch.rand(512, generator=g, dtype=F64) * 0.98 + 0.01)
    c = (a + 0.05 * torch.randn(512, generator=g, dtype=F64)).clamp(max=0.0)
    for dtype in (torch.bfloat16, torch.float16):
        lo = probability_change(c.to(dtype), a.to(dtype))
        assert lo.dtype == torch.float32
        assert torch.equal(lo, probability_change(c.to(dtype).float(), a.to(dtype).float()))
    assert probability_change(c.float(), a.float()).dtype == torch.float32


def _bf16_batch(seed=0, B=3, T=64):
    g = torch.Generator().manual_seed(seed)
    a = torch.log(torch.rand(B, T, generator=g, dtype=F64) * 0.98 + 0.01)
    c = (a + 0.2 * torch.randn(B, T, generator=g, dtype=F64)).clamp(max=0.0)
    adv = torch.randn(B, T, generator=g, dtype=F64)
    c[0, 3], a[1, 5] = NAN, INF
    return c.bfloat16(), a.bfloat16(), adv.bfloat16()


def test_every_reader_of_p_minus_q_reads_the_one_helper():
    c, a, adv = _bf16_batch()
    d, diff = probability_change(c, a), probability_difference(c, a)
    assert d[0, 3] == 0 and d[1, 5] == 0
    # prob_diff: |p - q| <= threshold, in float32 from bf16 inputs
    pd = probability_difference_mask(c, a, adv, threshold=0.05)
    assert torch.equal(pd.keep, diff <= 0.05) and torch.equal(pd.divergence, diff)
    # DPPO's Binary-TV: the signed change, bounded on the advantage's side
    tv = binary_tv_mask(c, a, adv, delta_low=0.03, delta_high=0.04)
    assert torch.equal(tv.keep, torch.where(adv > 0, d <= 0.04, d >= -0.03)) and torch.equal(tv.divergence, d)
    # CPPO's divergence (what the budget sums and the quantile reads)
    mask = torch.ones(c.shape, dtype=torch.bfloat16)
    cp = cppo_mask(c, a, adv, mask, TokenLayout.padded(*c.shape), delta=0.2, w_min=0.8, delta_b=0.02)
    assert torch.equal(cp.mask.divergence, diff)
    # the prob_diff rejection rule's token statistic
    rule = RejectionRule(statistic="prob_diff", aggregation="token", max=0.05)
    out = evaluate_rule(rule, c, a, mask, TokenLayout.padded(*c.shape))
    assert torch.equal(out.token_stat, diff)
    # each reader gives the bf16 inputs the masks of their float32 values (one dtype)
    c32, a32, adv32 = c.float(), a.float(), adv.float()
    assert torch.equal(pd.keep, probability_difference_mask(c32, a32, adv32, threshold=0.05).keep)
    assert torch.equal(tv.keep, binary_tv_mask(c32, a32, adv32, delta_low=0.03, delta_high=0.04).keep)


def _cppo_inputs(**keys):
    g = torch.Generator().manual_seed(1)
    a = torch.log(torch.rand(2, 48, generator=g, dtype=F64) * 0.9 + 0.05)
    c = (a + 0.6 * torch.randn(2, 48, generator=g, dtype=F64)).clamp(max=-1e-3)
    adv = torch.randn(2, 48, generator=g, dtype=F64)
    c, a, adv = c.float(), a.float(), adv.float()
    m = torch.ones(2, 48)
    lay = TokenLayout.padded(2, 48)
    cfg = ClippedPGLossConfig(policy_objective="cppo", cppo_delta=0.05, cppo_delta_b=0.01, **keys)
    return ObjectiveInputs(cfg, c, a, adv, m, m, lay, unmasked_positions(m, lay))


def test_cppo_decides_a_move_toward_the_anchor_with_the_configured_clamp():
    """token_log_ratio_clamp v forces every ratio into [e^-v, e^v]; at v = 1e-12 every r is 1 in float32, no token
    moves, and CPPO keeps every token (the mask's ratio is the surrogate's). Under the default clamp (20) the same
    batch has tokens dropped."""
    default = objective_of(_cppo_inputs().config).surrogate(_cppo_inputs())
    assert bool(default.surrogate.clipped.any())
    tiny = _cppo_inputs(token_log_ratio_clamp=1e-12)
    out = objective_of(tiny.config).surrogate(tiny)
    assert bool((out.surrogate.ratio == 1.0).all())
    assert not bool(out.surrogate.clipped.any())
