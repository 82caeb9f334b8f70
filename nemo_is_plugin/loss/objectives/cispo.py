"""``cispo``: CISPO's clipped importance-sampling weight on REINFORCE's score (MiniMax-M1, arXiv 2506.13585).

    L = -A sg(clip(r, 1 - eps_low, 1 + eps_high)) log pi,    r = pi / pi_old at the token level

The clipped weight carries no gradient; the log-prob does, so a token outside the band keeps its gradient (PPO's clip
drops it). Selected by ``policy_objective: cispo``, or by NeMo-RL's ``use_cispo: true`` while ``policy_objective`` is
``ppo_clip`` (NVIDIA-NeMo/RL ``nemo_rl/algorithms/loss/loss_functions.py`` @ 7ea279ab, ``ClippedPGLossFn``; verl's
``cispo`` loss mode, ``compute_policy_loss_cispo``; slime's ``--advantage-estimator cispo``).

Keys: NeMo-RL's ``ratio_clip_min`` / ``ratio_clip_max`` are eps_low / eps_high (NeMo-RL's CISPO recipe: 1.0 and
a large eps_high), and PPO's ``max_log_ratio`` caps log r before the clip (``PPOClipKeys``). NeMo-RL's rules are kept:
token-level aggregation only, no dual clip (``ratio_clip_c``), no sequence-level ratio; the log-space clip keys are
refused (CISPO clips in ratio space).
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
from nemo_is_plugin.loss.objectives.ppo_clip import PPOClipKeys, format_number, ratio_score_centering_refusals
from nemo_is_plugin.loss.ratios import policy_log_ratio

if TYPE_CHECKING:
    from nemo_is_plugin.loss.objectives.config_view import ObjectiveConfig

# PPOClipKeys' log-space keys: CISPO clips in ratio space, it reads only max_log_ratio of that section.
LOG_SPACE_KEYS = ("log_ratio_clip_low", "log_ratio_clip_high", "log_ratio_clip_c", "clip_position_power")


def cispo_surrogate(
    log_ratio: torch.Tensor, curr: torch.Tensor, advantages: torch.Tensor, *, clip_low: float, clip_high: float
) -> SurrogateOut:
    """CISPO: -A sg(clip(r)) log pi; the clipped weight carries no gradient, the log-prob does. log_ratio, curr,
    advantages: Float[*T]."""
    ratio = torch.exp(log_ratio)
    clipped_ratio = ratio.clamp(1 - clip_low, 1 + clip_high)
    loss = -advantages * clipped_ratio.detach() * curr
    r = ratio.detach()
    return SurrogateOut(  # no dual clip (refused with CISPO)
        loss=loss,
        ratio=r,
        clipped_ratio=clipped_ratio.detach(),
        clipped=(r != clipped_ratio.detach()),
        clipped_low=(r < 1 - clip_low) & (advantages < 0),
        clipped_high=(r > 1 + clip_high) & (advantages > 0),
    )


@register_objective
class CISPO(PolicyObjective):
    name = "cispo"
    keys = PPOClipKeys
    ratio_levels = ("token",)
    ratio = "the token ratio"
    summary = "'cispo' (CISPO: -A sg(clip r) log pi; NeMo-RL's use_cispo)"

    def surrogate(self, t: ObjectiveInputs) -> ObjectiveOut:
        cfg, c = t.config, t.curr
        log_r = policy_log_ratio(
            "token",
            c,
            t.anchor,
            t.token_mask,
            t.layout,
            token_clamp=cfg.token_log_ratio_clamp,
            max_log_ratio=PPOClipKeys.of(cfg).max_log_ratio,
        )
        sur = cispo_surrogate(log_r, c, t.advantages, clip_low=cfg.ratio_clip_min, clip_high=cfg.ratio_clip_max)
        return ObjectiveOut(sur)

    def refusals(self, cfg: ObjectiveConfig) -> list[str]:
        out = []
        if not cfg.token_level_loss:
            out.append(f"{chosen_as(cfg)} requires token_level_loss=true (NeMo-RL's rule: CISPO is token-level)")
        fields = type(PPOClipKeys.of(cfg)).model_fields  # the config's, where PPOClipKeys declares these keys
        out += [
            f"{key} configures PPO's log-space clip; {chosen_as(cfg)} clips in ratio space (ratio_clip_min/max): "
            f"unset {key}"
            for key in LOG_SPACE_KEYS
            if getattr(cfg, key) != fields[key].default
        ]
        return out

    def score_centering_refusals(self, cfg: ObjectiveConfig) -> list[str]:
        return ratio_score_centering_refusals(cfg)

    def describe(self, cfg: ObjectiveConfig) -> str:
        low, high = format_number(1 - cfg.ratio_clip_min), format_number(1 + cfg.ratio_clip_max)
        return f"CISPO: stop-gradient weight clamp(r, {low}, {high}) times -A * log pi"


__all__ = ["CISPO", "LOG_SPACE_KEYS", "cispo_surrogate"]
