"""``sapo``: SAPO's soft gate (arXiv 2511.20347; verl ``sapo``).

L = -A sigmoid(tau (r - 1)) 4 / tau, tau = tau_pos if A > 0 else tau_neg, r = exp(clamp(c - a, +-20)). The gate's
slope at r = 1 is 1, so near the anchor SAPO is the plain ratio objective; no token is dropped (its clip fractions are
0). verl forces ``seq-mean-token-mean`` whatever ``loss_agg_mode`` says: the verl adapter refuses another
``loss_agg_mode`` rather than override it silently; the plugin's own config accepts any aggregation. Source:
verl-project/verl ``verl/trainer/ppo/core_algos.py`` ``compute_policy_loss_sapo`` @ 1dda039b.
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
    SurrogateOut,
    TokenRatioObjective,
    register_objective,
)

if TYPE_CHECKING:
    from nemo_is_plugin.loss.objectives.config_view import ObjectiveConfig


class SapoKeys(KeySection):
    """SAPO's gate temperatures (verl's ``tau_pos`` / ``tau_neg``)."""

    sapo_tau_pos: Annotated[
        float,
        NumericRange(
            low=0.0,
            low_open=True,
            why="the gate sigmoid(tau (r - 1)) 4 / tau divides by tau",
            fix="use 1.0 (verl's tau_pos)",
        ),
    ] = Field(1.0, description="SAPO gate temperature for A > 0.")
    sapo_tau_neg: Annotated[
        float,
        NumericRange(
            low=0.0,
            low_open=True,
            why="the gate sigmoid(tau (r - 1)) 4 / tau divides by tau",
            fix="use 1.05 (verl's tau_neg)",
        ),
    ] = Field(1.05, description="SAPO gate temperature for A <= 0.")


def sapo_surrogate(
    log_ratio: torch.Tensor, advantages: torch.Tensor, *, tau_pos: float, tau_neg: float
) -> SurrogateOut:
    """-A sigmoid(tau (r - 1)) 4 / tau with tau by advantage sign. log_ratio, advantages: Float[*T]."""
    ratio = torch.exp(log_ratio)
    tau = torch.where(
        advantages > 0,
        torch.full_like(ratio, tau_pos),
        torch.full_like(ratio, tau_neg),
    )
    gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    return SurrogateOut(loss=-gate * advantages, ratio=ratio.detach())  # a soft gate: nothing clipped


@register_objective
class Sapo(TokenRatioObjective):
    name = "sapo"
    keys = SapoKeys
    summary = "'sapo' (soft gate)"

    def surrogate(self, t: ObjectiveInputs) -> ObjectiveOut:
        keys = SapoKeys.of(t.config)
        sur = sapo_surrogate(t.token_log_ratio(), t.advantages, tau_pos=keys.sapo_tau_pos, tau_neg=keys.sapo_tau_neg)
        return ObjectiveOut(sur)

    def describe(self, cfg: ObjectiveConfig) -> str:
        keys = SapoKeys.of(cfg)
        return (
            f"sapo: soft gate sigmoid(tau (r - 1)) 4 / tau, tau {keys.sapo_tau_pos:g} (A > 0) / "
            f"{keys.sapo_tau_neg:g} (A <= 0)"
        )


__all__ = ["Sapo", "SapoKeys", "sapo_surrogate"]
