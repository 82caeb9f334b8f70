"""``dro``: DRO's regularised policy gradient, L = -(A c - beta / 2 (c - a)^2) (verl ``dro``; verl-project/verl
``verl/trainer/ppo/core_algos.py`` ``compute_policy_loss_dro`` @ 1dda039b): the quadratic term pulls the policy back to
the anchor. The log-ratio is not clamped, as verl. ``ratio_level``, PPO's clip and the dual clip are refused with it.
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
    PolicyObjective,
    SurrogateOut,
    register_objective,
)

if TYPE_CHECKING:
    from nemo_is_plugin.loss.objectives.config_view import ObjectiveConfig


class DroKeys(KeySection):
    """DRO's penalty weight (verl's ``policy_loss.dro_beta``)."""

    dro_beta: Annotated[
        float | None,
        NumericRange(
            low=0.0,
            low_open=True,
            why="DRO's penalty beta/2 (log r)^2 must pull the policy back to the anchor; beta <= 0 pushes it away",
            fix="use a positive value (verl's policy_loss.dro_beta)",
        ),
    ] = Field(None, description="DRO quadratic-penalty weight beta (dro; required there).")


def dro_surrogate(curr: torch.Tensor, anchor: torch.Tensor, advantages: torch.Tensor, *, beta: float) -> SurrogateOut:
    """-(A c - beta / 2 (c - a)^2). curr: Float[*T] (requires grad); anchor, advantages: Float[*T]."""
    if not beta > 0:
        raise ValueError(f"DRO needs beta > 0 (verl policy_loss.dro_beta); got {beta}")
    d = curr - anchor
    loss = -(curr * advantages - 0.5 * beta * d * d)
    return SurrogateOut(loss=loss, ratio=torch.exp(d.detach()))  # a penalty on log r: nothing clipped


@register_objective
class Dro(PolicyObjective):
    name = "dro"
    keys = DroKeys
    required = ("dro_beta",)
    summary = "'dro' (-(A log pi - beta/2 (log r)^2))"

    def surrogate(self, t: ObjectiveInputs) -> ObjectiveOut:
        beta = DroKeys.of(t.config).dro_beta
        if beta is None:  # refused by the config (a required key)
            raise ValueError("policy_objective='dro' needs dro_beta")
        return ObjectiveOut(dro_surrogate(t.curr, t.anchor, t.advantages, beta=beta))

    def describe(self, cfg: ObjectiveConfig) -> str:
        beta = DroKeys.of(cfg).dro_beta
        return f"dro: none; -(A log pi - {'null' if beta is None else f'{beta:g}'}/2 (log r)^2)"

    def describe_ratio(self, cfg: ObjectiveConfig) -> str:
        return "none: policy_objective='dro' reads log pi itself"


__all__ = ["Dro", "DroKeys", "dro_surrogate"]
