"""``reinforce``: REINFORCE's score-function loss, no policy ratio (REINFORCE / RLOO, arXiv 2402.14740).

    L = -A log pi;  with ``ratio_clip_c`` NeMo-RL's dual clip still applies (A < 0): L = min(L, -A c)

Selected by ``policy_objective: reinforce``, or by NeMo-RL's ``disable_ppo_ratio: true`` while ``policy_objective``
is ``ppo_clip`` (NVIDIA-NeMo/RL ``nemo_rl/algorithms/loss/loss_functions.py`` @ 7ea279ab: its "ratio" is then the
log-prob itself, which NeMo-RL's ``probs_ratio`` metrics report under that switch, and only then; verl's
``rollout_correction.loss_type: reinforce`` in bypass mode).

Keys: ``ratio_clip_c`` (the dual clip). NeMo-RL ignores ``ratio_clip_min`` / ``_max`` under ``disable_ppo_ratio``, so
they are accepted then (NeMo-RL configs carry them); named as ``policy_objective: reinforce`` they are refused, as
PPO's log-space clip and ``max_log_ratio`` always are. ``sequence_level_importance_ratios`` sets the IS level only.
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
from nemo_is_plugin.loss.objectives.ppo_clip import apply_dual_clip, format_number

if TYPE_CHECKING:
    from nemo_is_plugin.loss.objectives.config_view import ObjectiveConfig


def reinforce_surrogate(curr: torch.Tensor, advantages: torch.Tensor, *, dual_clip: float | None) -> SurrogateOut:
    """L = -A log pi, no ratio (NeMo-RL's metrics under ``disable_ppo_ratio`` report the log-prob as its ratio: the
    loss's NeMo-RL metrics do so, :func:`~nemo_is_plugin.loss.metrics.nemo_rl_ratios`); the dual clip still applies.
    curr, advantages: Float[*T]."""
    loss, dual = apply_dual_clip(-advantages * curr, advantages, dual_clip)
    return SurrogateOut(loss=loss, dual_clipped=dual)


@register_objective
class Reinforce(PolicyObjective):
    name = "reinforce"
    ratio_levels = ("token",)
    ratio = "no policy ratio (-A log pi)"
    summary = "'reinforce' (REINFORCE: -A log pi; NeMo-RL's disable_ppo_ratio)"

    def surrogate(self, t: ObjectiveInputs) -> ObjectiveOut:
        return ObjectiveOut(reinforce_surrogate(t.curr, t.advantages, dual_clip=t.config.ratio_clip_c))

    def score_centering_refusals(self, cfg: ObjectiveConfig) -> list[str]:
        return []  # its gradient is a token's own score times -A: the head coefficients model it

    def describe(self, cfg: ObjectiveConfig) -> str:
        dual = f", dual clip c = {format_number(cfg.ratio_clip_c)}" if cfg.ratio_clip_c is not None else ""
        return "none" + dual

    def describe_ratio(self, cfg: ObjectiveConfig) -> str | None:
        return "none: REINFORCE surrogate -A * log pi"


__all__ = ["Reinforce", "reinforce_surrogate"]
