"""``prob_diff``: the sign-independent probability-difference trust region (prime-rl's ``ipo`` loss).

Keep token t while |p_t - q_t| <= threshold (p = exp(c), q = exp(a)), whatever the advantage sign; loss on kept
tokens -A r, r = exp(clamp(c - a, +-20)). The advantage only splits the metric quadrants. prime-rl adds a separate
tau_kl (log r)^2 term: the plugin's KL term plays that part. Source: PrimeIntellect-ai/prime-rl
``src/prime_rl/trainer/rl/loss.py`` ``ipo_loss_fn`` @ 559b44772e471d1538537b8805cc77f3824a5e64 (``loss.type="ipo"``,
``ipo_threshold``; q = the inference policy, the plugin's bypass setting). Its IS-side twin is the rejection rule
``statistic: prob_diff`` (``loss/rejection.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import torch
from pydantic import Field

from nemo_is_plugin.config.field_types import NumericRange
from nemo_is_plugin.config.keys import KeySection
from nemo_is_plugin.loss.objectives.base import (
    ObjectiveInputs,
    ObjectiveOut,
    TokenRatioObjective,
    TrustMask,
    masked_ratio_surrogate,
    register_objective,
    split_by_sign,
)
from nemo_is_plugin.loss.ratios import probability_difference

if TYPE_CHECKING:
    from nemo_is_plugin.loss.objectives.config_view import ObjectiveConfig


class ProbDiffKeys(KeySection):
    """prime-rl's ``ipo_threshold``."""

    prob_diff_threshold: Annotated[
        float,
        NumericRange(
            low=0.0,
            high=1.0,
            low_open=True,
            why="a token is kept while |p - q| <= threshold; probabilities differ by at most 1, so a threshold "
            "above 1 keeps everything and one <= 0 drops every token that moved",
            fix="use 0.1 (prime-rl's ipo_threshold)",
        ),
    ] = Field(0.1, description="prob_diff: keep a token while |p - q| <= this.")


@torch.no_grad()
def probability_difference_mask(
    curr: torch.Tensor, anchor: torch.Tensor, advantages: torch.Tensor, *, threshold: float
) -> TrustMask:
    """Drop a token whose probability moved more than ``threshold`` either way, whatever the advantage sign.
    ``advantages`` only splits the metric quadrants."""
    diff = probability_difference(curr, anchor)
    return split_by_sign(diff <= threshold, advantages, diff)


@register_objective
class ProbDiff(TokenRatioObjective):
    name = "prob_diff"
    keys = ProbDiffKeys
    summary = "'prob_diff' (prime-rl's |p - q| mask)"

    def surrogate(self, t: ObjectiveInputs) -> ObjectiveOut:
        threshold = ProbDiffKeys.of(t.config).prob_diff_threshold
        trust = probability_difference_mask(t.curr.detach(), t.anchor, t.advantages, threshold=threshold)
        return ObjectiveOut(masked_ratio_surrogate(t.token_log_ratio(), t.advantages, trust))

    def describe(self, cfg: ObjectiveConfig) -> str:
        return f"prob_diff: drop a token with |p - q| > {ProbDiffKeys.of(cfg).prob_diff_threshold:g}; loss -A r"


__all__ = ["ProbDiff", "ProbDiffKeys", "probability_difference_mask"]
