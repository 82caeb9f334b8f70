"""Rejection rules: keep a token or a sequence while a divergence between pi_prev and mu stays in bounds.

y_t = clamp(p_t - g_t, -c, c) (c = the rule's ``log_ratio_clamp``: a -inf generation log-prob gives y = +c, verl's
value; NaN, and without a clamp every non-finite value, counts 0), m = token mask.

=========  =================  ========================================================================================
statistic  per token          what it measures
=========  =================  ========================================================================================
k1         -y_t               KL(mu || pi_prev), unbiased, signed (its sequence sum is -log of the sequence ratio)
k2         y_t^2 / 2          the same KL, biased, >= 0
k3         e^y_t - 1 - y_t    the same KL, unbiased, >= 0
prob_diff  |e^p_t - e^g_t|    the probability difference of the sampled token, in [0, 1] (no clamp: see
                              ratios.probability_difference); prime-rl's probability-difference mask on the IS side
=========  =================  ========================================================================================

Aggregations: ``token`` (the statistic itself), ``sequence_sum`` = sum_t m_t k_t, ``sequence_mean`` =
sum_t m_t k_t / (sum_t m_t + 1e-8), ``sequence_max`` = max over unmasked tokens (0 for a sequence without tokens), as
verl's ``rollout_rs`` options ``token_kj`` / ``seq_sum_kj`` / ``seq_mean_kj`` / ``seq_max_kj``. A rule keeps what
satisfies ``min <= statistic <= max``; several rules must all pass. Sequence reductions go through the layout, so CP
shards get the full-sequence statistic (sum and max all-reduced over the CP group).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from nemo_is_plugin.loss.layout import TokenLayout
from nemo_is_plugin.loss.masked import EPS, where_mask
from nemo_is_plugin.loss.ratios import probability_difference


class RuleSpec(Protocol):
    """What a rule provides, read-only (``nemo_is_plugin.config.RejectionRule`` is one, and :class:`Rule`)."""

    @property
    def statistic(self) -> str: ...
    @property
    def aggregation(self) -> str: ...
    @property
    def min(self) -> float | None: ...
    @property
    def max(self) -> float | None: ...
    @property
    def log_ratio_clamp(self) -> float | None: ...
    @property
    def name(self) -> str: ...


@dataclass(frozen=True)
class Rule:
    """A plain :class:`RuleSpec` (the config's ``RejectionRule`` is the validated one)."""

    statistic: str
    aggregation: str
    min: float | None = None
    max: float | None = None
    log_ratio_clamp: float | None = None

    @property
    def name(self) -> str:
        return f"{self.aggregation}_{self.statistic}"


def band_rule(kind: str, low: float, high: float) -> Rule:
    """``seq-mis`` / ``geo-rs`` keeping low <= exp(sum_t x_t) / exp(mean_t x_t) <= high: the k1 rule on
    [-log high, -log low] (k1 = -x), unclamped (config.RejectionRule.from_band is the same rule, validated)."""
    aggregation = "sequence_sum" if kind == "seq-mis" else "sequence_mean"
    return Rule("k1", aggregation, -math.log(high), -math.log(low), None)


@dataclass
class RuleOutcome:
    """One rule on one batch (all detached).

    token_stat: Float[*T] the statistic per token (the sequence's value on every token for sequence aggregations).
    seq_stat: Float[S] the sequence statistic, None for ``token`` rules.
    keep: Bool[*T] tokens the rule keeps.
    """

    name: str
    token_stat: torch.Tensor
    seq_stat: torch.Tensor | None
    keep: torch.Tensor


@torch.no_grad()
def token_statistic(statistic: str, y: torch.Tensor) -> torch.Tensor:
    """k1 / k2 / k3 of the (clamped) log-ratio y (Float[*T] -> Float[*T])."""
    if statistic == "k1":
        return -y
    if statistic == "k2":
        return 0.5 * y * y
    if statistic == "k3":
        return torch.exp(y) - 1.0 - y
    raise ValueError(
        f"unknown rejection statistic {statistic!r}; expected k1, k2 or k3 (prob_diff: rule_token_statistic)"
    )


@torch.no_grad()
def rule_token_statistic(rule: RuleSpec, prev: torch.Tensor, gen: torch.Tensor) -> torch.Tensor:
    """The rule's statistic per token: prob_diff from the log-probs, k1 / k2 / k3 from their clamped log-ratio."""
    if rule.statistic == "prob_diff":
        return probability_difference(prev, gen)
    return token_statistic(rule.statistic, clamped_log_ratio(prev, gen, rule.log_ratio_clamp))


@torch.no_grad()
def clamped_log_ratio(prev: torch.Tensor, gen: torch.Tensor, clamp: float | None) -> torch.Tensor:
    """y = clamp(prev - gen, -clamp, clamp); NaN, and without a clamp every non-finite value, becomes 0."""
    x = prev - gen
    if clamp is None:
        return torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)
    return torch.nan_to_num(x, nan=0.0).clamp(-clamp, clamp)


@torch.no_grad()
def evaluate_rule(
    rule: RuleSpec, prev: torch.Tensor, gen: torch.Tensor, token_mask: torch.Tensor, layout: TokenLayout
) -> RuleOutcome:
    """Apply one rule. prev, gen, token_mask: Float[*T]; the sequence statistics count ``token_mask``'s tokens."""
    stat = rule_token_statistic(rule, prev, gen)
    seq_stat = None
    if rule.aggregation == "token":
        value = stat
    else:
        seq_stat = _sequence_statistic(rule.aggregation, stat, token_mask, layout)
        value = layout.to_tokens(seq_stat)
    keep = torch.ones_like(value, dtype=torch.bool)
    if rule.min is not None:
        keep = keep & (value >= rule.min)
    if rule.max is not None:
        keep = keep & (value <= rule.max)
    return RuleOutcome(rule.name, value, seq_stat, keep)


def _sequence_statistic(aggregation: str, stat: torch.Tensor, token_mask: torch.Tensor, layout: TokenLayout):
    if aggregation == "sequence_max":
        top = layout.seq_max(torch.where(token_mask != 0, stat, torch.full_like(stat, float("-inf"))))
        return torch.where(torch.isneginf(top), torch.zeros_like(top), top)
    total = layout.seq_sum(where_mask(stat, token_mask))
    if aggregation == "sequence_sum":
        return total
    if aggregation == "sequence_mean":
        return total / (layout.seq_sum(token_mask.to(stat.dtype)) + EPS)
    raise ValueError(f"unknown rejection aggregation {aggregation!r}")


@torch.no_grad()
def evaluate_rules(
    rules: Sequence[RuleSpec], prev: torch.Tensor, gen: torch.Tensor, token_mask: torch.Tensor, layout: TokenLayout
) -> tuple[torch.Tensor, tuple[RuleOutcome, ...]]:
    """All rules: (Bool[*T] tokens every rule keeps, the outcome of each rule)."""
    outcomes = tuple(evaluate_rule(rule, prev, gen, token_mask, layout) for rule in rules)
    keep = torch.ones(prev.shape, dtype=torch.bool, device=prev.device)
    for outcome in outcomes:
        keep = keep & outcome.keep
    return keep, outcomes


__all__ = [
    "Rule",
    "RuleOutcome",
    "RuleSpec",
    "band_rule",
    "clamped_log_ratio",
    "evaluate_rule",
    "evaluate_rules",
    "rule_token_statistic",
    "token_statistic",
]
