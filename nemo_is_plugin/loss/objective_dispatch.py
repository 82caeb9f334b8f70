"""The configured ``policy_objective`` as a per-token surrogate: which trust mask or gate, with which keys.

The anchor a is the old log-prob the ratio divides by (pi_old, or the rollout policy mu under
``old_policy_logprobs: generation``), already set to the current value on tokens that do not count
(``clipped_pg.ratio_anchor``). The surrogates are those of ``objectives`` (formulas and sources: docs/objectives.md);
``ClippedPGLoss`` multiplies them by the IS weights, adds the KL term and aggregates, as for PPO's clip.

The token log-ratio d = c - a of DPPO, prob_diff, CPPO and SAPO is clamped at +-20 before exponentiating, as verl
and UniRL do (``token_log_ratio_clamp`` replaces the 20 when set). GMPO, GPG and DRO use the raw difference, as verl.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nemo_is_plugin.config import ClippedPGLossConfig
from nemo_is_plugin.loss.layout import TokenLayout
from nemo_is_plugin.loss.metrics import MetricBook
from nemo_is_plugin.loss.objectives import (
    divergence_pg_surrogate,
    dro_surrogate,
    gmpo_surrogate,
    gpg_surrogate,
    masked_ratio_surrogate,
    sapo_surrogate,
)
from nemo_is_plugin.loss.prefix_budget import (
    BUDGET_QUANTILE,
    PrefixBudgetMask,
    cppo_divergence,
    cppo_mask,
    sequence_quantile,
)
from nemo_is_plugin.loss.ratios import token_log_ratio
from nemo_is_plugin.loss.surrogate import SurrogateOut
from nemo_is_plugin.loss.trust_masks import binary_kl_mask, binary_tv_mask, probability_difference_mask

# verl (compute_policy_loss_dppo_tv / _sapo) and UniRL (_cppo_mask) clamp the token log-ratio here.
OBJECTIVE_LOG_RATIO_CLAMP = 20.0
# Objectives whose per-token loss needs the whole sequence (a sequence sum, a quantile, a prefix budget): their
# gradient is not known chunk by chunk (loss/separable.py).
SEQUENCE_OBJECTIVES = ("gmpo", "cppo")


@dataclass
class ObjectiveOut:
    """The objective's per-token surrogate, and CPPO's budget (None for the others) for its metrics."""

    surrogate: SurrogateOut
    budget: PrefixBudgetMask | None = None


def _required(value: float | None, key: str) -> float:
    if value is None:  # the config refuses this; a config built without validation reaches here
        raise ValueError(f"the configured policy_objective needs {key}")
    return value


def objective_surrogate(
    cfg: ClippedPGLossConfig,
    curr: torch.Tensor,
    anchor: torch.Tensor,
    advantages: torch.Tensor,
    token_mask: torch.Tensor,
    layout: TokenLayout,
) -> ObjectiveOut:
    """The surrogate of ``cfg.policy_objective`` (not ``ppo_clip``). All Float[*T] of ``layout``; ``curr`` requires
    grad. The layout is read by the sequence objectives only (GMPO's sums, CPPO's positions, prefix sums, quantile)."""
    objective = cfg.policy_objective
    clamp = cfg.token_log_ratio_clamp if cfg.token_log_ratio_clamp is not None else OBJECTIVE_LOG_RATIO_CLAMP
    if objective in ("dppo_tv", "dppo_kl"):
        rule = binary_tv_mask if objective == "dppo_tv" else binary_kl_mask
        trust = rule(
            curr.detach(),
            anchor,
            advantages,
            delta_low=_required(cfg.dppo_delta_low, "dppo_delta_low"),
            delta_high=_required(cfg.dppo_delta_high, "dppo_delta_high"),
        )
        d = token_log_ratio(curr, anchor, clamp)
        return ObjectiveOut(divergence_pg_surrogate(d, curr, advantages, trust, ratio_cap=cfg.dppo_ratio_cap))
    if objective == "prob_diff":
        trust = probability_difference_mask(curr.detach(), anchor, advantages, threshold=cfg.prob_diff_threshold)
        return ObjectiveOut(masked_ratio_surrogate(token_log_ratio(curr, anchor, clamp), advantages, trust))
    if objective == "cppo":
        quantile = None
        if not layout.holds_whole_sequences:  # a CP shard: the quantile from the sequences gathered over the group
            divergence, whole = layout.gather_sequences(cppo_divergence(curr.detach(), anchor))
            mask, _ = layout.gather_sequences(token_mask)
            quantile = sequence_quantile(divergence, mask, whole, BUDGET_QUANTILE)
        budget = cppo_mask(
            curr.detach(),
            anchor,
            advantages,
            token_mask,
            layout,
            delta=cfg.cppo_delta,
            w_min=cfg.cppo_w_min,
            delta_b=cfg.cppo_delta_b,
            quantile=quantile,
        )
        sur = masked_ratio_surrogate(token_log_ratio(curr, anchor, clamp), advantages, budget.mask)
        return ObjectiveOut(sur, budget)
    if objective == "sapo":
        d = token_log_ratio(curr, anchor, clamp)
        return ObjectiveOut(sapo_surrogate(d, advantages, tau_pos=cfg.sapo_tau_pos, tau_neg=cfg.sapo_tau_neg))
    if objective == "gmpo":
        low = _required(cfg.gmpo_clip_low, "gmpo_clip_low")
        high = _required(cfg.gmpo_clip_high, "gmpo_clip_high")
        return ObjectiveOut(gmpo_surrogate(curr, anchor, advantages, token_mask, layout, clip_low=low, clip_high=high))
    if objective == "gpg":
        return ObjectiveOut(gpg_surrogate(curr, advantages))
    if objective == "dro":
        return ObjectiveOut(dro_surrogate(curr, anchor, advantages, beta=_required(cfg.dro_beta, "dro_beta")))
    raise ValueError(f"policy_objective={objective!r} has no surrogate here (ppo_clip is ClippedPGLoss's own)")


def report_objective(book: MetricBook, out: ObjectiveOut, sample_mask: torch.Tensor) -> None:
    """The objective's own metrics beside the clip fractions every surrogate reports (``clip_fraction_high`` /
    ``_low``: tokens dropped with A > 0 / A <= 0). CPPO: ``cppo_budget_bound_fraction`` (valid tokens dropped by the
    budget alone, per token), ``cppo_budget_exhausted_seq_fraction`` (sequences whose budget ran out somewhere) and
    ``cppo_budget_rate_mean`` (the mean budget rate b) and ``cppo_budget_exhausted_position_fraction`` (the fraction
    of a sequence's tokens before its budget runs out, 1 where it never does), per sequence."""
    budget = out.budget
    if budget is None:
        return
    exhausted = torch.isfinite(budget.first_exhausted)
    book.token_mean("cppo_budget_bound_fraction", budget.budget_bound.double())
    book.seq_mean("cppo_budget_exhausted_seq_fraction", exhausted.double(), sample_mask)
    book.seq_mean("cppo_budget_rate_mean", budget.rate.double(), sample_mask)
    # where the budget runs out: the fraction of the sequence's tokens before it (1 when it never does)
    n = book.layout.seq_sum((book.valid != 0).double()).clamp_min(1.0)
    before = torch.where(exhausted, (budget.first_exhausted.double() - 1.0) / n, torch.ones_like(n))
    book.seq_mean("cppo_budget_exhausted_position_fraction", before, sample_mask)


__all__ = [
    "OBJECTIVE_LOG_RATIO_CLAMP",
    "SEQUENCE_OBJECTIVES",
    "ObjectiveOut",
    "objective_surrogate",
    "report_objective",
]
