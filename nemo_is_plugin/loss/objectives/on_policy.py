"""``on_policy``: the truly on-policy ratio, 1 with the policy gradient (NeMo-RL's ``force_on_policy_ratio``).

    pi_old = sg(pi):  r = exp(c - sg c) (value 1, gradient grad c), never clipped:  L = -A r;
    with ``ratio_clip_c`` the dual clip still applies (A < 0): L = min(L, -A c), inactive since c > 1 = r

Selected by ``policy_objective: on_policy``, or by NeMo-RL's ``force_on_policy_ratio: true`` while
``policy_objective`` is ``ppo_clip`` (NVIDIA-NeMo/RL ``nemo_rl/algorithms/loss/loss_functions.py`` @ 7ea279ab,
which tests it before ``disable_ppo_ratio``: with both set this objective is computed). It requires one update per
rollout: the old log-probs are the current ones, so ``prev_logprobs`` are not read and the IS weights compare sg(c)
with mu (``pi_old_is_current``); the fused loss takes two passes.

Keys: ``ratio_clip_c``. NeMo-RL ignores ``ratio_clip_min`` / ``_max`` (and ``disable_ppo_ratio``) under
``force_on_policy_ratio``, so they are accepted then; named, the clip bounds are refused. PPO's log-space clip and
``max_log_ratio`` are refused: they bound a ratio that is always 1 (they never bind). ``ratio_level`` token or
sequence is accepted (NeMo-RL's ``sequence_level_importance_ratios`` sets the IS level; the ratio stays 1).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from nemo_is_plugin.loss.objectives.base import (
    ObjectiveInputs,
    ObjectiveOut,
    PolicyObjective,
    SurrogateOut,
    chosen_as,
    register_objective,
)
from nemo_is_plugin.loss.objectives.ppo_clip import apply_dual_clip, format_number

if TYPE_CHECKING:
    from nemo_is_plugin.loss.objectives.config_view import ObjectiveConfig


def on_policy_surrogate(curr: torch.Tensor, advantages: torch.Tensor, *, dual_clip: float | None) -> SurrogateOut:
    """r = exp(c - sg[c]) (value 1, gradient grad c), never clipped: L = -A r; the dual clip still applies.
    curr, advantages: Float[*T]."""
    ratio = torch.exp(curr - curr.detach())
    loss, dual = apply_dual_clip(-advantages * ratio, advantages, dual_clip)
    return SurrogateOut(loss=loss, ratio=ratio.detach(), dual_clipped=dual)


@register_objective
class OnPolicy(PolicyObjective):
    name = "on_policy"
    ratio_levels = ("token", "sequence")
    ratio = "the ratio fixed to 1 (exp(c - sg c))"
    summary = "'on_policy' (ratio 1 with the policy gradient, pi_old = sg pi; NeMo-RL's force_on_policy_ratio)"
    pi_old_is_current = True

    def surrogate(self, t: ObjectiveInputs) -> ObjectiveOut:
        return ObjectiveOut(on_policy_surrogate(t.curr, t.advantages, dual_clip=t.config.ratio_clip_c))

    def refusals(self, cfg: ObjectiveConfig) -> list[str]:
        if cfg.bypasses_prev:
            return [f"old_policy_logprobs='generation' and {chosen_as(cfg)} both choose pi_old; keep one"]
        return []

    def score_centering_refusals(self, cfg: ObjectiveConfig) -> list[str]:
        return []  # its gradient is a token's own score times -A (the ratio is 1): the head coefficients model it

    def describe(self, cfg: ObjectiveConfig) -> str:
        dual = f", dual clip c = {format_number(cfg.ratio_clip_c)}" if cfg.ratio_clip_c is not None else ""
        return "none: the ratio is 1" + dual

    def describe_ratio(self, cfg: ObjectiveConfig) -> str | None:
        return "fixed to 1 with the policy gradient: exp(c - sg c), pi_old = sg pi"


__all__ = ["OnPolicy", "on_policy_surrogate"]
