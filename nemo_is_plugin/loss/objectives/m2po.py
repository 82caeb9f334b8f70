"""``m2po``: Second-Moment Trust Policy Optimization (Zheng et al., arXiv 2510.01161), as its authors implement it.

Source: Infini-AI-Lab/M2PO ``verl/trainer/ppo/core_algos.py`` @ 4514ce22cc5af605b150d3bb7d0deab82f783acd:
``compute_m2po_policy_loss``, ``kpo_clip_harmful_tokens``, ``_get_trust_region_tokens_delta_sq`` and
``_solve_tau_from_sorted_delta2``. PPO's clip, with bounds chosen per batch from the second moment of the log-ratio
Delta = a - c (a: the anchor, pi_old; c: the current log-prob, detached):

1. harmful tokens: valid tokens with A_s > 1e-12 and r > 1 + 1e-12, or A_s < -1e-12 and r < 1 - 1e-12, where
   r = exp(c - a) and A_s is the advantage of the sequence's first counted token (the authors' ``advantages[:, 0]``,
   the first response token of verl's rows; GRPO's advantage is the same on every token);
2. M2 = mean of Delta^2 over the n harmful tokens; with n = 0 or M2 <= budget + 1e-12 no bound applies: the ratio
   bounds are [0, 1e5] (the authors' early return);
3. otherwise tau^2 = the largest harmful Delta_j^2 whose capped second moment sum_i min(Delta_i^2, Delta_j^2) is below
   budget * n (0 when there is none), tau = |Delta_j| of that token: the ratio bounds are [exp(-tau), exp(tau)], i.e.
   eps_low = 1 - exp(-tau), eps_high = exp(tau) - 1, each raised to its floor when one is set (the authors'
   ``miniclip_low`` / ``_high``; their training scripts leave them unset);
4. L = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high)): PPO's clip, no dual clip, the bounds carry no gradient;
   applied in log space (``ppo_clip.log_space_clip_surrogate`` at log bounds log(1 - eps_low), log(1 + eps_high)), so
   the token that sets tau sits exactly on its bound, unclipped (below).

Where it differs from the authors', and why:

- the statistic spans the whole batch of the call across every process that holds part of it: the CP ranks (the
  layout's sums) and the DP ranks (``TokenLayout.reduce_batch_sums`` / ``_max``: the entry points' explicit DP group).
  The authors compute it per micro-batch on each DP rank (their verl fork has no reduction): equal with one DP rank,
  where the plugin's loss, gradient and metrics equal the single-process ones under any layout.
- tau^2 is found without a host synchronisation: the largest float64 x with sum_i min(Delta_i^2, x) < budget * n is
  searched bit by bit (8 rounds of 256 candidates, each one all-reduce), then tau^2 is the largest harmful Delta^2 at
  or below it (one max all-reduce). The authors' loop (``.item()`` per step) picks the same sorted value up to its
  1e-12 slack terms, which decide only where the capped moment is within n * 1e-12 of the budget.
- the token that sets tau keeps its gradient. The authors take tau = sqrt(Delta_j^2 - 1e-12), just below that token's
  |Delta_j|, but then round exp(+-tau) to float32 (``torch.exp(torch.tensor(tau))``), which absorbs the slack: with
  their float32 log-probs the token sits on the bound and is not clipped, except where float32 rounding happens to fall
  the other way (1 of 200 random batches with tau > 0 in tests/loss/test_m2po.py's measure; with float64 log-probs
  the rounding decides it in about half of them, 104 of 200). Their M2_after counts the token at its own value, not
  capped. The plugin takes tau = |Delta_j| exactly (the largest |Delta| among the kept harmful tokens, no square root)
  and clips in log space, so the token is unclipped in every dtype (a float64 tau 1e-12 short, as before, clipped it,
  gradient 0, in every float64 batch and 8 of 200 float32 ones). The bounds are computed in float64.

The log-ratio is not clamped (as the authors'), unless ``token_log_ratio_clamp`` is set. Metrics (additive, per token of
the global count): ``m2po_harmful_fraction``, ``m2po_harmful_log_ratio_sq`` (sum of the harmful Delta^2) and
``m2po_capped_log_ratio_sq`` (the same capped at tau^2: the authors' ``M2_after``, which is M2 itself when nothing is
capped), from which ``finalize_metrics`` derives ``m2po_m2`` and ``m2po_m2_after`` (the authors' ``m2po/M2`` and
``m2po/M2_after``; 0 when no token is harmful, as the authors log it, so that every call reports the same names);
the bounds used, ``m2po_clip_low_min`` / ``_max`` and ``m2po_clip_high_min`` / ``_max`` (the authors'
``m2po/clip_low`` / ``clip_high``). verl has no ``m2po`` loss mode (the 0.9.1 release's registry, and no M2PO page in
verl's docs/algo at head): select it in verl with ``policy_loss.nemo_is.policy_objective: m2po``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated

import torch
from pydantic import Field

from nemo_is_plugin.config.field_types import NumericRange
from nemo_is_plugin.config.keys import KeySection
from nemo_is_plugin.loss.layout import TokenLayout
from nemo_is_plugin.loss.masked import where_mask
from nemo_is_plugin.loss.objectives.base import ObjectiveInputs, ObjectiveOut, PolicyObjective, register_objective
from nemo_is_plugin.loss.objectives.ppo_clip import log_space_clip_surrogate

if TYPE_CHECKING:
    from nemo_is_plugin.loss.objectives.base import ObjectiveBook
    from nemo_is_plugin.loss.objectives.config_view import ObjectiveConfig

# The authors' constants: the sign and ratio slack of a harmful token, the slack of the budget test and of tau, and
# the ratio bounds when nothing is constrained.
SLACK = 1e-12
UNBOUNDED_RATIO = (0.0, 1e5)
DIGIT_BITS = 8  # the search for tau^2: 8 rounds of 2^8 candidates over the 63 bits of a non-negative float64


class M2POKeys(KeySection):
    """M2PO's second-moment budget and the floors of its clip ranges."""

    m2po_budget: Annotated[
        float,
        NumericRange(
            low=0.0,
            low_open=True,
            why="the bound on the mean squared log-ratio of the harmful tokens; 0 or less leaves no harmful token "
            "its update (the authors' solver fails on 0)",
            fix="use 0.04 (the authors' training scripts)",
        ),
    ] = Field(0.04, description="M2PO: bound on the second moment M2 of the harmful tokens' log-ratios.")
    m2po_clip_low_floor: Annotated[
        float | None,
        NumericRange(
            low=0.0,
            high=1.0,
            why="eps_low = max(1 - exp(-tau), floor) and the lower ratio bound 1 - eps_low must lie in [0, 1]",
            fix="use e.g. 0.3 (the authors' default argument) or null (their training scripts)",
        ),
    ] = Field(None, description="M2PO: the smallest eps_low (the authors' miniclip_low); null: none.")
    m2po_clip_high_floor: Annotated[
        float | None,
        NumericRange(
            low=0.0,
            why="eps_high = max(exp(tau) - 1, floor) and the upper ratio bound 1 + eps_high must be >= 1",
            fix="use e.g. 0.5 (the authors' default argument) or null (their training scripts)",
        ),
    ] = Field(None, description="M2PO: the smallest eps_high (the authors' miniclip_high); null: none.")


@dataclass
class M2POBounds:
    """The batch's clip and what its metrics read. log_low / log_high: 0-d float64, the log-ratio bounds the clip
    applies (log(1 - eps_low), log(1 + eps_high)); eps_low / eps_high: 0-d float64 (after the floors). harmful:
    Bool[*T]. delta_sq: Float64[*T] Delta^2 on harmful tokens, 0 elsewhere. capped: the same capped at tau^2 (not
    capped where no bound applies or tau = 0, as the authors' M2_after)."""

    log_low: torch.Tensor
    log_high: torch.Tensor
    eps_low: torch.Tensor
    eps_high: torch.Tensor
    harmful: torch.Tensor
    delta_sq: torch.Tensor
    capped: torch.Tensor


def first_token_advantage(
    advantages: torch.Tensor, valid: torch.Tensor, layout: TokenLayout, positions: torch.Tensor
) -> torch.Tensor:
    """Each token's sequence advantage A_s: the advantage of the sequence's first counted token (``positions`` = 1),
    across CP shards (one shard holds it; the others add 0). Float[*T]."""
    first = (valid != 0) & (positions == 1)
    return layout.to_tokens(layout.seq_sum(where_mask(advantages, first.to(advantages.dtype))))


def capped_sums(sorted_values: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
    """sum_i min(values_i, x) for each candidate x, from this process's values (>= 0) sorted ascending: one
    ``searchsorted``. sorted_values: Float64[N]; candidates: Float64[K] -> Float64[K]."""
    below = torch.searchsorted(sorted_values, candidates)  # how many values lie below each candidate
    csum = torch.cat([sorted_values.new_zeros(1), torch.cumsum(sorted_values, 0)])
    return csum[below] + candidates * (sorted_values.numel() - below).to(sorted_values.dtype)


def largest_below(values: torch.Tensor, target: torch.Tensor, layout: TokenLayout) -> torch.Tensor:
    """The largest float64 x >= 0 with sum_i min(values_i, x) < ``target`` over the whole batch (every process's
    ``values``, reduced with ``layout.reduce_batch_sums``), searched on the bit pattern of x, which orders non-negative
    float64 values: 8 rounds of 256 candidates, no host synchronisation. Needs target > 0 (x = 0 satisfies it)."""
    ordered = torch.sort(values.reshape(-1)).values
    prefix = torch.zeros((), dtype=torch.int64, device=values.device)
    digits = torch.arange(2**DIGIT_BITS, dtype=torch.int64, device=values.device)
    for shift in range(64 - DIGIT_BITS, -1, -DIGIT_BITS):
        candidates = (prefix | (digits << shift)).view(torch.float64)
        below = layout.reduce_batch_sums(capped_sums(ordered, candidates)) < target
        if shift == 64 - DIGIT_BITS:  # the sign bit stays 0: those candidates are negative floats
            below = below & (digits < 2 ** (DIGIT_BITS - 1))
        # the sums grow with the candidate, so the ones below the target come first: take the last of them
        prefix = prefix | ((below.sum() - 1).clamp_min(0) << shift)
    return prefix.view(torch.float64)


@torch.no_grad()
def m2po_bounds(
    delta: torch.Tensor,
    advantages: torch.Tensor,
    valid: torch.Tensor,
    positions: torch.Tensor,
    layout: TokenLayout,
    *,
    budget: float,
    low_floor: float | None = None,
    high_floor: float | None = None,
) -> M2POBounds:
    """M2PO's clip ranges for the batch (module docstring). delta: Float[*T] a - c (detached); advantages, valid,
    positions: Float[*T] of ``layout``."""
    ratio = torch.exp(-delta)
    seq_adv = first_token_advantage(advantages, valid, layout, positions)
    harmful = (valid != 0) & (
        ((seq_adv > SLACK) & (ratio > 1.0 + SLACK)) | ((seq_adv < -SLACK) & (ratio < 1.0 - SLACK))
    )
    delta_sq = torch.where(harmful, delta.double().square(), 0.0)
    totals = layout.reduce_batch_sums(torch.stack([harmful.sum().double(), delta_sq.sum()]))
    n, total = totals[0], totals[1]
    unbounded = (n == 0) | (total / n.clamp_min(1.0) <= budget + SLACK)
    target = torch.where(unbounded, 1.0, budget * n)  # any positive target where the search is not used
    x = largest_below(delta_sq, target, layout)
    # tau^2 and tau of the kept harmful token with the largest Delta^2 (its |Delta| itself: no square root, so that
    # the token sits exactly on the bound), in one max reduction
    kept = harmful & (delta_sq <= x)
    neg_inf = torch.full_like(delta_sq, -math.inf)
    both = torch.stack([torch.where(kept, delta_sq, neg_inf), torch.where(kept, delta.double().abs(), neg_inf)])
    both = torch.cat([both.reshape(2, -1), both.new_full((2, 1), -math.inf)], dim=1).amax(1)
    tau_sq, tau = layout.reduce_batch_max(both).unbind(0)
    none_kept = torch.isneginf(tau_sq)  # the authors' k = 0: tau = 0, and M2_after is M2 itself
    tau = torch.where(none_kept, torch.zeros_like(tau), tau)
    log_low = torch.where(unbounded, math.log(UNBOUNDED_RATIO[0]) if UNBOUNDED_RATIO[0] > 0 else -math.inf, -tau)
    log_high = torch.where(unbounded, math.log(UNBOUNDED_RATIO[1]), tau)
    if low_floor is not None:  # eps_low >= floor: the lower ratio bound at most 1 - floor
        log_low = log_low.clamp_max(math.log1p(-low_floor) if low_floor < 1.0 else -math.inf)
    if high_floor is not None:
        log_high = log_high.clamp_min(math.log1p(high_floor))
    eps_low, eps_high = 1.0 - torch.exp(log_low), torch.exp(log_high) - 1.0
    capped = torch.where(unbounded | none_kept, delta_sq, torch.minimum(delta_sq, tau_sq.clamp_min(0.0)))
    return M2POBounds(log_low, log_high, eps_low, eps_high, harmful, delta_sq, capped)


@register_objective
class M2PO(PolicyObjective):
    name = "m2po"
    keys = M2POKeys
    ratio_levels = ("token",)
    ratio = "the token ratio (its clip bounds come from the token log-ratios' second moment)"
    summary = "'m2po' (PPO's clip with bounds from the batch's second moment of log r)"

    def surrogate(self, t: ObjectiveInputs) -> ObjectiveOut:
        keys = M2POKeys.of(t.config)
        log_r = t.token_log_ratio(default_clamp=None)
        bounds = m2po_bounds(
            -log_r.detach(),
            t.advantages,
            t.valid,
            t.positions,
            t.layout,
            budget=keys.m2po_budget,
            low_floor=keys.m2po_clip_low_floor,
            high_floor=keys.m2po_clip_high_floor,
        )
        dtype = log_r.dtype
        sur = log_space_clip_surrogate(
            log_r,
            t.advantages,
            t.positions,
            eps_low=-bounds.log_low.to(dtype),
            eps_high=bounds.log_high.to(dtype),
            eps_c=None,
            power=0.0,
        )
        return ObjectiveOut(sur, bounds)

    def differentiates_ratio(self, cfg: ObjectiveConfig) -> bool:
        return True  # PPO's ratio clip of the unclamped token log-ratio, as the authors'

    def whole_batch_reason(self, cfg: ObjectiveConfig) -> str:
        return "policy_objective='m2po' needs every log-prob of the batch before any gradient (its clip bounds)"

    def report(self, book: ObjectiveBook, out: ObjectiveOut, sample_mask: torch.Tensor) -> None:
        bounds: M2POBounds = out.state
        book.token_mean("m2po_harmful_fraction", bounds.harmful.double())
        book.token_mean("m2po_harmful_log_ratio_sq", bounds.delta_sq)
        book.token_mean("m2po_capped_log_ratio_sq", bounds.capped)
        one = torch.ones(1, dtype=torch.bool, device=bounds.eps_low.device)
        book.extrema("m2po_clip_low", bounds.eps_low.reshape(1), one)
        book.extrema("m2po_clip_high", bounds.eps_high.reshape(1), one)

    def finalize(self, metrics: Mapping[str, float]) -> dict[str, float]:
        fraction = metrics.get("m2po_harmful_fraction")
        if fraction is None:
            return {}
        if not fraction:  # no harmful token: no bound applied; both present (0), so every call reports the same names
            return {"m2po_m2": 0.0, "m2po_m2_after": 0.0}
        return {
            "m2po_m2": metrics["m2po_harmful_log_ratio_sq"] / fraction,
            "m2po_m2_after": metrics["m2po_capped_log_ratio_sq"] / fraction,
        }

    def describe(self, cfg: ObjectiveConfig) -> str:
        keys = M2POKeys.of(cfg)
        floors = [
            f"{name} floor {value:g}"
            for name, value in (("eps_low", keys.m2po_clip_low_floor), ("eps_high", keys.m2po_clip_high_floor))
            if value is not None
        ]
        return (
            f"m2po: PPO's clip with bounds exp(+-tau) chosen per batch so that the harmful tokens' second moment of "
            f"log r stays within {keys.m2po_budget:g}" + (f" ({', '.join(floors)})" if floors else "")
        )


__all__ = ["M2PO", "M2POBounds", "M2POKeys", "capped_sums", "first_token_advantage", "largest_below", "m2po_bounds"]
