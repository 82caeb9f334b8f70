"""``cppo``: CPPO's trust region (arXiv 2606.10968, "Beyond Uniform Token-Level Trust Region in LLM RL"; Binary-TV
variant as merged in Tencent-Hunyuan/UniRL ``unirl/algorithms/cppo.py``, PR #58): a position-weighted per-token
Binary-TV threshold plus a cumulative prefix-average divergence budget. Only the mask changes; the loss on kept tokens
is -A r (``masked_ratio_surrogate``), r = exp(clamp(c - a, +-20)) (the clamp: ``token_log_ratio_clamp`` when set; the
same r decides which tokens move toward the anchor).

Per sequence, over its n unmasked tokens at 1-based positions k = 1..n (q: anchor probability, p: current):

    D_k = |p_k - q_k|                                   Binary-TV divergence
    w_k = 1 - (1 - w_min) (k - 1) / max(n - 1, 1)      decreasing from 1 to w_min
    Z_k = w_k D_k,  S_k = sum_{j<k} Z_j,  W_k = sum_{j<k} w_j    (exclusive prefix sums)
    b   = clamp(quantile_0.9(D), delta_b, 2 delta_b)   the sequence's budget rate
    c_k = min(delta, delta + b W_k - S_k)
    keep_k = [A_k (r_k - 1) <= 0]  or  [Z_k <= c_k]     a move back toward the anchor is always kept

The budget term b W_k - S_k falls below 0 once the weighted prefix divergence outruns its allowance: from there on
the threshold tightens below delta ("budget exhausted"). With delta_b = inf the budget never binds and the mask is
the position-weighted per-token rule Z_k <= delta alone.

The divergences and prefix sums are computed in at least float32 (float64 stays float64), whatever the input dtype:
a bf16 prefix sum over a long response loses the budget to rounding (UniRL PR #58). The prefix sums go through the
layout (exact across packed sequences and CP shards); the 0.9-quantile needs every token of a sequence: under CP the
caller passes it (computed from the sequence gathered across the group), else a split layout is refused.

Masked tokens (padding, tool output) take no position and add nothing to the prefix sums; UniRL's sequences hold
response tokens only, where the two agree.

Under CP the 0.9-quantile is taken from the sequences all-gathered over the CP group (``TokenLayout.gather_sequences``);
the prefix sums are CP-exact without it (tests/distributed/test_objectives_cp.py). Metrics: ``clip_fraction`` = dropped,
``cppo_budget_bound_fraction`` (tokens dropped by the budget alone, per token), ``cppo_budget_exhausted_seq_fraction``
(sequences whose budget ran out), ``cppo_budget_rate_mean`` (the mean budget rate b) and
``cppo_budget_exhausted_position_fraction`` (the fraction of a sequence before its budget runs out, 1 where it never
does), per sequence. Source: Tencent-Hunyuan/UniRL ``unirl/algorithms/cppo.py`` ``_cppo_mask`` @
30899fcf229bb9b42db20f067fd2ea9165981051.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated

import torch
from pydantic import Field

from nemo_is_plugin.config.field_types import NumericRange
from nemo_is_plugin.config.keys import KeySection
from nemo_is_plugin.loss.layout import TokenLayout
from nemo_is_plugin.loss.masked import where_mask
from nemo_is_plugin.loss.objectives.base import (
    OBJECTIVE_LOG_RATIO_CLAMP,
    ObjectiveInputs,
    ObjectiveOut,
    TokenRatioObjective,
    TrustMask,
    masked_ratio_surrogate,
    register_objective,
)
from nemo_is_plugin.loss.ratios import probability_difference, token_log_ratio, unmasked_positions

if TYPE_CHECKING:
    from nemo_is_plugin.loss.objectives.base import ObjectiveBook
    from nemo_is_plugin.loss.objectives.config_view import ObjectiveConfig


class CppoKeys(KeySection):
    """CPPO's per-token threshold, last-position weight and budget-rate floor (UniRL's defaults)."""

    cppo_delta: Annotated[
        float,
        NumericRange(
            low=0.0,
            high=1.0,
            low_open=True,
            why="CPPO's per-token TV threshold on w_k |p - q| <= 1; 0 or less drops every token that moved",
            fix="use 0.2 (UniRL)",
        ),
    ] = Field(0.2, description="CPPO per-token TV threshold delta.")
    cppo_w_min: Annotated[
        float,
        NumericRange(
            low=0.0,
            high=1.0,
            low_open=True,
            why="the last position's weight: weights fall linearly from 1 to w_min; 0 exempts the last token, "
            "above 1 the weights grow",
            fix="use 0.8 (UniRL), or 1 for uniform weights",
        ),
    ] = Field(0.8, description="CPPO weight of a sequence's last position (the first has 1).")
    cppo_delta_b: Annotated[
        float,
        NumericRange(
            low=0.0,
            why="the floor of the per-sequence budget rate b = clamp(quantile_0.9(D), delta_b, 2 delta_b); "
            "a negative rate exhausts the budget at the first token",
            fix="use 0.02 (UniRL)",
        ),
    ] = Field(0.02, description="CPPO budget rate floor (the ceiling is twice it).")


BUDGET_QUANTILE = 0.9


@dataclass
class PrefixBudgetMask:
    """mask: the trust region (``TrustMask``; its ``divergence`` is D). budget_bound: Bool[*T] tokens dropped by the
    budget although within their per-token threshold (Z_k <= delta). first_exhausted: Float[S] 1-based position of
    the first token whose budget term is negative (inf when the budget never binds). rate: Float[S] the budget b."""

    mask: TrustMask
    budget_bound: torch.Tensor
    first_exhausted: torch.Tensor
    rate: torch.Tensor


@torch.no_grad()
def sequence_quantile(values: torch.Tensor, token_mask: torch.Tensor, layout: TokenLayout, q: float) -> torch.Tensor:
    """[S] per-sequence q-quantile of ``values`` over unmasked tokens, linearly interpolated (``torch.quantile``'s
    default); 0 for a sequence without tokens. Needs whole sequences on this process."""
    if not layout.holds_whole_sequences:
        raise ValueError(
            "a per-sequence quantile needs every token of the sequence; this layout splits sequences across "
            "context-parallel ranks (gather the sequence first)"
        )
    flat = torch.where(token_mask != 0, values, torch.full_like(values, float("inf"))).reshape(-1)
    seq = layout.seq_index.reshape(-1)
    # Sort by (sequence, value): masked tokens (+inf) go last within their sequence.
    by_value = torch.argsort(flat, stable=True)
    order = by_value[torch.argsort(seq[by_value], stable=True)]
    ordered = flat[order]
    tokens = layout.seq_sum(torch.ones_like(values, dtype=torch.float64)).long()
    starts = torch.cumsum(tokens, 0) - tokens
    n = layout.seq_sum((token_mask != 0).to(torch.float64))
    pos = q * (n - 1).clamp_min(0)
    lo, hi = pos.floor().long(), pos.ceil().long()
    last = (tokens - 1).clamp_min(0)
    idx_lo = starts + torch.minimum(lo, last)
    idx_hi = starts + torch.minimum(hi, last)
    if ordered.numel() == 0:
        return torch.zeros(layout.num_seqs, dtype=values.dtype, device=values.device)
    v_lo, v_hi = ordered[idx_lo.clamp_max(ordered.numel() - 1)], ordered[idx_hi.clamp_max(ordered.numel() - 1)]
    frac = (pos - lo).to(values.dtype)
    # torch.quantile's interpolation is lerp; where hi == lo it must not meet inf - inf (a masked slot).
    out = torch.where(hi == lo, v_lo, torch.lerp(v_lo, v_hi, frac))
    return torch.where(n > 0, out, torch.zeros_like(out))


@torch.no_grad()
def cppo_mask(
    curr: torch.Tensor,
    anchor: torch.Tensor,
    advantages: torch.Tensor,
    token_mask: torch.Tensor,
    layout: TokenLayout,
    *,
    delta: float,
    w_min: float,
    delta_b: float,
    quantile: torch.Tensor | None = None,
    log_ratio: torch.Tensor | None = None,
) -> PrefixBudgetMask:
    """CPPO Binary-TV keep-mask (module formulas). UniRL's defaults: delta 0.2, w_min 0.8, delta_b 0.02.

    Args:
        curr, anchor, advantages, token_mask: Float[*T] token tensors of ``layout``.
        delta: per-token TV threshold. w_min: the last position's weight, in (0, 1]. delta_b: budget rate floor (the
            ceiling is 2 delta_b); inf disables the budget.
        quantile: Float[S] each sequence's 0.9-quantile of D, when the caller has it (under CP: from the sequence
            gathered across the group); None computes it here (whole sequences only, see ``sequence_quantile``).
        log_ratio: Float[*T] the surrogate's log-ratio (``ObjectiveInputs.token_log_ratio``: clamped at
            ``token_log_ratio_clamp``), whose sign decides a move toward the anchor; None: c - a clamped at
            ``OBJECTIVE_LOG_RATIO_CLAMP`` (UniRL's 20).
    """
    if not 0.0 < w_min <= 1.0:
        raise ValueError(f"CPPO w_min must be in (0, 1]; got {w_min}")
    if not delta_b >= 0.0:
        raise ValueError(f"CPPO delta_b must be >= 0; got {delta_b}")
    divergence = probability_difference(curr, anchor)
    dtype = divergence.dtype
    if log_ratio is None:
        log_ratio = token_log_ratio(curr, anchor, OBJECTIVE_LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio.detach())  # the surrogate's ratio (UniRL's clamp at 20 by default), in the input dtype
    toward_anchor = advantages * (ratio - 1.0) <= 0.0
    m = (token_mask != 0).to(dtype)
    k = unmasked_positions(token_mask, layout).to(dtype)
    n = layout.to_tokens(layout.seq_sum(m))
    w = 1.0 - (1.0 - w_min) * (k - 1.0) / (n - 1.0).clamp_min(1.0)
    z = where_mask(w * divergence, m)
    w_in = where_mask(w, m)
    # Exclusive prefix sums; exact zeros at each sequence's first token (inclusive - own value rounds to +-1 ulp on
    # a packed layout, which would read as a budget already exhausted).
    first = k == 1.0
    zero = torch.zeros((), dtype=dtype, device=z.device)
    s_prev = torch.where(first, zero, layout.prefix_sum(z) - z)
    w_prev = torch.where(first, zero, layout.prefix_sum(w_in) - w_in)
    if quantile is None:
        quantile = sequence_quantile(divergence, token_mask, layout, BUDGET_QUANTILE)
    rate = quantile.to(dtype).clamp(delta_b, 2.0 * delta_b)
    if delta_b == float("inf"):
        slack = torch.full_like(z, float("inf"))
    else:
        slack = layout.to_tokens(rate) * w_prev - s_prev
    threshold = torch.minimum(torch.full_like(z, delta), delta + slack)
    within_token = z <= delta
    keep = toward_anchor | (z <= threshold)
    positive = advantages > 0
    mask = TrustMask(keep, ~keep & positive, ~keep & ~positive, divergence)
    exhausted = (slack < 0) & (m != 0)
    first = layout.seq_min(torch.where(exhausted, k, torch.full_like(k, float("inf"))))
    return PrefixBudgetMask(mask, ~keep & within_token, first, rate)


@register_objective
class Cppo(TokenRatioObjective):
    name = "cppo"
    keys = CppoKeys
    summary = "'cppo' (position-weighted TV mask with a prefix budget)"

    def surrogate(self, t: ObjectiveInputs) -> ObjectiveOut:
        keys, layout, curr = CppoKeys.of(t.config), t.layout, t.curr.detach()
        log_ratio = t.token_log_ratio()
        quantile = None
        if not layout.holds_whole_sequences:  # a CP shard: the quantile from the sequences gathered over the group
            divergence, whole = layout.gather_sequences(probability_difference(curr, t.anchor))
            mask, _ = layout.gather_sequences(t.token_mask)
            quantile = sequence_quantile(divergence, mask, whole, BUDGET_QUANTILE)
        budget = cppo_mask(
            curr,
            t.anchor,
            t.advantages,
            t.token_mask,
            layout,
            delta=keys.cppo_delta,
            w_min=keys.cppo_w_min,
            delta_b=keys.cppo_delta_b,
            quantile=quantile,
            log_ratio=log_ratio,
        )
        return ObjectiveOut(masked_ratio_surrogate(log_ratio, t.advantages, budget.mask), budget)

    def whole_batch_reason(self, cfg: ObjectiveConfig) -> str:
        return "policy_objective='cppo' needs every log-prob of a sequence before any gradient"

    def report(self, book: ObjectiveBook, out: ObjectiveOut, sample_mask: torch.Tensor) -> None:
        budget: PrefixBudgetMask = out.state
        exhausted = torch.isfinite(budget.first_exhausted)
        book.token_mean("cppo_budget_bound_fraction", budget.budget_bound.double())
        book.seq_mean("cppo_budget_exhausted_seq_fraction", exhausted.double(), sample_mask)
        book.seq_mean("cppo_budget_rate_mean", budget.rate.double(), sample_mask)
        # where the budget runs out: the fraction of the sequence's tokens before it (1 when it never does)
        n = book.layout.seq_sum((book.valid != 0).double()).clamp_min(1.0)
        before = torch.where(exhausted, (budget.first_exhausted.double() - 1.0) / n, torch.ones_like(n))
        book.seq_mean("cppo_budget_exhausted_position_fraction", before, sample_mask)

    def describe(self, cfg: ObjectiveConfig) -> str:
        keys = CppoKeys.of(cfg)
        return (
            f"cppo: position-weighted |p - q| <= {keys.cppo_delta:g} (w_min {keys.cppo_w_min:g}) with a prefix "
            f"budget (rate floor {keys.cppo_delta_b:g}); loss -A r"
        )


__all__ = [
    "BUDGET_QUANTILE",
    "Cppo",
    "CppoKeys",
    "PrefixBudgetMask",
    "cppo_mask",
    "sequence_quantile",
]
