"""Tapered REINFORCE: REINFORCE's score-function loss with a weight that decays along the response,

    L_t = -A_t * gamma^(n_t - 1) * log pi(y_t)

n_t the 1-based position of token t among its sequence's counted tokens, gamma = ``tapered_reinforce_decay`` in (0, 1]
(1 is REINFORCE). No policy ratio and nothing clipped, so the result carries the loss alone; the plugin's IS weights,
truncation, KL and aggregation apply around it as around every objective. Built on ``nemo_is_plugin.objectives``
alone (docs/writing_an_objective.md).
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from nemo_is_plugin.objectives import (
    KeySection,
    NumericRange,
    ObjectiveConfig,
    ObjectiveInputs,
    ObjectiveOut,
    PolicyObjective,
    SurrogateOut,
    register_objective,
)


class TaperedReinforceKeys(KeySection):
    """The objective's one key: a flat ``loss_fn`` key, validated with its range like the plugin's own."""

    tapered_reinforce_decay: Annotated[
        float,
        NumericRange(
            low=0.0,
            low_open=True,
            high=1.0,
            why="the weight gamma^(n-1) must stay positive and must not grow along the response",
            fix="use a decay in (0, 1], e.g. 0.999 (1 is plain REINFORCE)",
        ),
    ] = Field(0.999, description="gamma in L_t = -A_t gamma^(n_t - 1) log pi(y_t).")


def tapered_weight(positions, decay: float):
    """gamma^(n - 1) for the 1-based positions n (a tensor; the weight takes the positions' device)."""
    return decay ** (positions - 1.0)


@register_objective
class TaperedReinforce(PolicyObjective):
    name = "tapered_reinforce"
    keys = TaperedReinforceKeys
    ratio = "no policy ratio (-A gamma^(n-1) log pi)"
    summary = "'tapered_reinforce' (-A gamma^(n-1) log pi)"

    def surrogate(self, t: ObjectiveInputs) -> ObjectiveOut:
        decay = TaperedReinforceKeys.of(t.config).tapered_reinforce_decay
        weight = tapered_weight(t.positions.to(t.curr.dtype), decay)
        return ObjectiveOut(SurrogateOut(loss=-t.advantages * weight * t.curr))

    def describe(self, cfg: ObjectiveConfig) -> str:
        return f"none (-A {TaperedReinforceKeys.of(cfg).tapered_reinforce_decay:g}^(n-1) log pi)"
