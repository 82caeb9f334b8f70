"""``gmpo``: GMPO's geometric-mean sequence ratio (arXiv 2507.20673; verl ``geo_mean``).

Per token, d = c - a is clipped to [-eps_low, eps_high] only on the side the advantage pushes (A > 0: from above,
A < 0: from below; A = 0 tokens count log-ratio 0, as verl's sign(A) product gives). The sequence loss is
loss_i = -Abar_i exp(sum_t m d~_t / (n_i + 1e-8)), Abar_i the sequence's mean advantage, returned on every token of
the sequence. Sums go through the layout, so CP shards get the full-sequence value. Source: verl-project/verl
``verl/trainer/ppo/core_algos.py`` ``compute_policy_loss_geo_mean`` @ 1dda039b.

A per-sequence loss needs a per-sequence mean, per-sequence IS weights (verl applies exp(mean log w): the
``sequence_mean`` level) and sequence rejections only: other settings are refused. verl ignores ``loss_agg_mode`` and
``global_batch_info`` and takes a plain mean over each micro-batch's rows, so with k micro-batches per mini-batch its
gradient is k times the plugin's (docs/verl.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import torch
from pydantic import Field

from nemo_is_plugin.config.field_types import NumericRange
from nemo_is_plugin.config.keys import KeySection
from nemo_is_plugin.loss.layout import TokenLayout
from nemo_is_plugin.loss.masked import EPS, where_mask
from nemo_is_plugin.loss.objectives.base import (
    ObjectiveInputs,
    ObjectiveOut,
    PolicyObjective,
    SurrogateOut,
    max_unclipped_on_tie,
    register_objective,
)

if TYPE_CHECKING:
    from nemo_is_plugin.loss.objectives.config_view import ObjectiveConfig


# GMPO's loss is one value per sequence: its IS weight is one per sequence too, the geometric mean of the tokens'.
GMPO_IS_LEVEL = "sequence_mean"


class GmpoKeys(KeySection):
    """GMPO's sign-aware log-ratio clip (GMPO: 0.4; verl: ``clip_ratio_low`` / ``_high``)."""

    gmpo_clip_low: Annotated[
        float | None,
        NumericRange(
            low=0.0,
            low_open=True,
            why="GMPO clips the token log-ratio of A < 0 tokens at -eps; eps <= 0 excludes log r = 0",
            fix="use e.g. 0.4 (GMPO's (e^-0.4, e^0.4)) or verl's clip_ratio_low",
        ),
    ] = Field(None, description="GMPO lower log-ratio clip eps_low (gmpo; required there).")
    gmpo_clip_high: Annotated[
        float | None,
        NumericRange(
            low=0.0,
            low_open=True,
            why="GMPO clips the token log-ratio of A > 0 tokens at eps; eps <= 0 excludes log r = 0",
            fix="use e.g. 0.4 (GMPO's (e^-0.4, e^0.4)) or verl's clip_ratio_high",
        ),
    ] = Field(None, description="GMPO upper log-ratio clip eps_high (gmpo; required there).")


def gmpo_surrogate(
    curr: torch.Tensor,
    anchor: torch.Tensor,
    advantages: torch.Tensor,
    token_mask: torch.Tensor,
    layout: TokenLayout,
    *,
    clip_low: float,
    clip_high: float,
) -> SurrogateOut:
    """The sequence loss (module docstring) on every token of its sequence: aggregate it with ``seq-mean-token-mean``.
    The clip indicators are verl's: d outside [-clip_low, clip_high] with A > 0 (``clipped_high``) / A < 0
    (``clipped_low``), whether or not the sign-aware clip moved it."""
    d = curr - anchor
    sign = torch.sign(advantages)
    clamped = d.clamp(-clip_low, clip_high)
    # sign min(sign d, sign clamped), a tie (d inside or on its bounds) going to d: see max_unclipped_on_tie
    d_tilde = -sign * max_unclipped_on_tie(-sign * d, -sign * clamped)
    mask = token_mask.to(d.dtype)
    count = layout.seq_sum(mask) + EPS
    seq_ratio = torch.exp(layout.seq_sum(where_mask(d_tilde, mask)) / count)
    seq_adv = layout.seq_sum(where_mask(advantages.to(d.dtype), mask)) / count
    loss = layout.to_tokens(-seq_adv * seq_ratio)
    clipped = (d != clamped).detach()
    r = torch.exp(d.detach())
    return SurrogateOut(  # no dual clip
        loss=loss,
        ratio=r,
        clipped_ratio=layout.to_tokens(seq_ratio.detach()),
        clipped=clipped & (advantages != 0),
        clipped_low=clipped & (advantages < 0),
        clipped_high=clipped & (advantages > 0),
    )


@register_objective
class Gmpo(PolicyObjective):
    name = "gmpo"
    keys = GmpoKeys
    required = ("gmpo_clip_low", "gmpo_clip_high")
    ratio = "its own per-sequence geometric mean"
    summary = "'gmpo' (geometric-mean sequence ratio)"

    def surrogate(self, t: ObjectiveInputs) -> ObjectiveOut:
        keys = GmpoKeys.of(t.config)
        low, high = keys.gmpo_clip_low, keys.gmpo_clip_high
        if low is None or high is None:  # refused by the config (required keys)
            raise ValueError("policy_objective='gmpo' needs gmpo_clip_low and gmpo_clip_high")
        sur = gmpo_surrogate(t.curr, t.anchor, t.advantages, t.token_mask, t.layout, clip_low=low, clip_high=high)
        return ObjectiveOut(sur)

    def whole_batch_reason(self, cfg: ObjectiveConfig) -> str:
        return "policy_objective='gmpo' needs every log-prob of a sequence before any gradient"

    def refusals(self, cfg: ObjectiveConfig) -> list[str]:
        """GMPO's loss is one value per sequence: only a per-sequence mean and per-sequence IS weights keep it one."""
        out = []
        if cfg.effective_loss_aggregation != "seq-mean-token-mean":
            out.append(
                f"policy_objective='gmpo' is a per-sequence loss averaged over sequences; loss_aggregation="
                f"{cfg.effective_loss_aggregation!r} would weight sequences by their length: set loss_aggregation: "
                "seq-mean-token-mean"
            )
        if cfg.use_importance_sampling_correction and cfg.effective_is_level != GMPO_IS_LEVEL:
            out.append(
                f"policy_objective='gmpo' needs one IS weight per sequence, the geometric mean (as verl's geo_mean): "
                f"set is_correction_level: sequence_mean (got {cfg.effective_is_level!r})"
            )
        token_rules = [rule.name for rule in cfg.rejection_rules if rule.aggregation == "token"]
        if token_rules:
            out.append(
                "policy_objective='gmpo' rejects whole sequences only: a token rejection rule would scale the "
                f"sequence's loss by its kept fraction; use a sequence rule instead of {', '.join(token_rules)}"
            )
        return out

    def describe(self, cfg: ObjectiveConfig) -> str:
        keys = GmpoKeys.of(cfg)
        return (
            f"gmpo: sequence geometric-mean ratio, token log-ratio clipped to [-{keys.gmpo_clip_low:g}, "
            f"{keys.gmpo_clip_high:g}] on the advantage's side"
        )

    def describe_ratio(self, cfg: ObjectiveConfig) -> str:
        return "per sequence: the geometric mean of the token ratios (policy_objective='gmpo')"


__all__ = ["GMPO_IS_LEVEL", "Gmpo", "GmpoKeys", "gmpo_surrogate"]
