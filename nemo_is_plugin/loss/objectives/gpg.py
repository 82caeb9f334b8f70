"""``gpg``: GPG's plain policy gradient, L = -A c with no ratio at all (verl ``gpg``; verl-project/verl
``verl/trainer/ppo/core_algos.py`` ``compute_policy_loss_gpg`` @ 1dda039b). It has no ratio and clips nothing, so it
reports neither ``probs_ratio`` nor clip fractions. No keys; ``ratio_level``, PPO's clip and the dual clip are refused
with it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from nemo_is_plugin.loss.objectives.base import (
    ObjectiveInputs,
    ObjectiveOut,
    PolicyObjective,
    SurrogateOut,
    register_objective,
)

if TYPE_CHECKING:
    from nemo_is_plugin.loss.objectives.config_view import ObjectiveConfig


def gpg_surrogate(curr: torch.Tensor, advantages: torch.Tensor) -> SurrogateOut:
    """-A c. curr: Float[*T] (requires grad)."""
    return SurrogateOut(loss=-advantages * curr)  # no ratio, nothing clipped


@register_objective
class Gpg(PolicyObjective):
    name = "gpg"
    summary = "'gpg' (-A log pi)"

    def surrogate(self, t: ObjectiveInputs) -> ObjectiveOut:
        return ObjectiveOut(gpg_surrogate(t.curr, t.advantages))

    def describe(self, cfg: ObjectiveConfig) -> str:
        return "gpg: none (-A log pi)"

    def describe_ratio(self, cfg: ObjectiveConfig) -> str:
        return "none: policy_objective='gpg' reads log pi itself"


__all__ = ["Gpg", "gpg_surrogate"]
