"""``ppo_clip``: PPO's clipped surrogate, NeMo-RL's objective and the default.

The ratio r = pi / pi_old at ``ratio_level`` (token, GSPO's sequence and sequence_token, CTPO's cumulative and
cumulative_mean: :mod:`nemo_is_plugin.loss.ratios`), then:

PPO clip:      L = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high));  dual clip (A < 0): L = min(L, -A c)
log-space:     L = max(-A r, -A exp(clamp(log r, -eps_low s_t, eps_high s_t)));  dual (A < 0): min(L, -A exp(eps_c s_t))
               with s_t = n_t ** power and n_t the 1-based position among unmasked tokens (CTPO; power 0 = fixed)

NeMo-RL's switches of this objective are objectives of their own, selected by those switches while
``policy_objective`` is ``ppo_clip`` (``nemo_rl_switches.NEMO_RL_SWITCHES``): ``cispo`` (``use_cispo``), ``reinforce``
(``disable_ppo_ratio``), ``on_policy`` (``force_on_policy_ratio``).

Keys: NeMo-RL's (``ratio_clip_min`` / ``_max`` / ``_c``) stay in NeMo-RL's block of ``config/keys.py``: they are
NeMo-RL's schema, kept whole; which of them each objective reads is NeMo-RL's table
(``nemo_rl_switches.NEMO_RL_RATIO_KEYS``), not the objective's. This
module's section holds the plugin's own clip keys (CTPO's log-space clip and the log-ratio cap), which ``cispo`` reads
too (its ``max_log_ratio``; it refuses the log-space ones); every other objective refuses them
(:meth:`PPOClipKeys.unread`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, get_args

import torch
from pydantic import Field

from nemo_is_plugin.config.field_types import NumericRange
from nemo_is_plugin.config.keys import KeySection, RatioLevel
from nemo_is_plugin.loss.objectives.base import (
    ObjectiveInputs,
    ObjectiveOut,
    PolicyObjective,
    SurrogateOut,
    chosen_as,
    max_unclipped_on_tie,
    register_objective,
)
from nemo_is_plugin.loss.ratios import policy_log_ratio, straight_through_log_ratio

if TYPE_CHECKING:
    from nemo_is_plugin.loss.objectives.config_view import ObjectiveConfig

CAUSAL_LEVELS = ("cumulative", "cumulative_mean")


class PPOClipKeys(KeySection):
    """The plugin's own keys of PPO's clip: CTPO's log-space clip with position-adaptive bounds, the cap on log r."""

    log_ratio_clip_low: Annotated[
        float | None,
        NumericRange(
            low=0.0,
            low_open=True,
            why="the log-space band is [-eps_low * t^p, eps_high * t^p]; eps <= 0 excludes log r = 0",
            fix="use e.g. 0.025 (CTPO) or leave both log_ratio_clip keys null",
        ),
    ] = Field(None, description="eps_low of the log-space clip: log r >= -eps_low * t^clip_position_power.")
    log_ratio_clip_high: Annotated[
        float | None,
        NumericRange(
            low=0.0,
            low_open=True,
            why="the log-space band is [-eps_low * t^p, eps_high * t^p]; eps <= 0 excludes log r = 0",
            fix="use e.g. 0.05 (CTPO) or leave both log_ratio_clip keys null",
        ),
    ] = Field(None, description="eps_high of the log-space clip: log r <= eps_high * t^clip_position_power.")
    log_ratio_clip_c: Annotated[
        float | None,
        NumericRange(
            low=0.0,
            low_open=True,
            why="the log-space dual clip caps the loss of A < 0 at -A * exp(eps_c * t^p), which must lie above 1",
            fix="use e.g. 0.05 (CTPO) or null",
        ),
    ] = Field(None, description="Log-space dual clip: for A < 0 the loss is capped at -A * exp(eps_c * t^power).")
    clip_position_power: Annotated[
        float,
        NumericRange(
            low=-1.0,
            high=1.0,
            why="a cumulative log-ratio grows at most linearly in the position t, so bounds eps * t^p with p > 1 "
            "outgrow every reachable log-ratio (the clip silently turns off) and p < -1 shrink faster than 1/t (every "
            "late token is clipped)",
            fix="use 0 (fixed bounds) or 0.5 (CTPO)",
        ),
    ] = Field(0.0, description="p in the position-adaptive bounds eps * t^p (CTPO uses 0.5); 0 gives fixed bounds.")
    max_log_ratio: Annotated[
        float | None,
        NumericRange(
            low=0.0,
            low_open=True,
            why="log r is capped at this value with zero gradient beyond; a cap <= 0 freezes every token whose "
            "ratio exceeds 1",
            fix="use e.g. 10 (CTPO) or null",
        ),
    ] = Field(None, description="Upper cap on the log of the policy ratio after building it (CTPO: 10).")

    @classmethod
    def unread(cls, cfg: Any, readers: list[str], chosen: str) -> list[str]:
        """Another objective replaces PPO's clip: these keys are refused with it (NeMo-RL's clip keys and switches:
        ``nemo_rl_switches.nemo_rl_key_refusals``)."""
        return [
            f"{key} configures PPO's ratio clip, which {chosen_as(cfg)} does not have: unset {key} (or use "
            "policy_objective: ppo_clip)"
            for key in cls.own_keys()
            if getattr(cfg, key) != type(cfg).model_fields[key].default
        ]


def uses_log_space_clip(cfg: ObjectiveConfig) -> bool:
    keys = PPOClipKeys.of(cfg)
    return keys.log_ratio_clip_low is not None or keys.log_ratio_clip_high is not None


def apply_dual_clip(loss: torch.Tensor, advantages: torch.Tensor, cap: torch.Tensor | float | None):
    """The dual clip: where A < 0 the loss is capped at -A cap (cap None: no dual clip); with its active tokens."""
    if cap is None:
        return loss, torch.zeros_like(loss, dtype=torch.bool)
    dual = -advantages * cap
    active = (advantages < 0) & (dual < loss)
    return torch.where(advantages < 0, torch.minimum(loss, dual), loss), active.detach()


def ratio_clip_surrogate(
    log_ratio: torch.Tensor,
    advantages: torch.Tensor,
    *,
    clip_low: float | torch.Tensor,
    clip_high: float | torch.Tensor,
    dual_clip: float | None = None,
) -> SurrogateOut:
    """PPO clip in ratio space. log_ratio, advantages: Float[*T]; the bounds are numbers or 0-d tensors (bounds chosen
    from the batch, on the device)."""
    ratio = torch.exp(log_ratio)
    low: Any = 1 - clip_low  # a number or a 0-d tensor: clamp takes either
    high: Any = 1 + clip_high
    clipped_ratio = ratio.clamp(low, high)
    loss1, loss2 = -advantages * ratio, -advantages * clipped_ratio
    loss, dual = apply_dual_clip(max_unclipped_on_tie(loss1, loss2), advantages, dual_clip)
    r = ratio.detach()
    return SurrogateOut(
        loss=loss,
        ratio=r,
        clipped_ratio=clipped_ratio.detach(),
        clipped=(loss2 > loss1).detach(),
        clipped_low=(r < 1 - clip_low) & (advantages < 0),
        clipped_high=(r > 1 + clip_high) & (advantages > 0),
        dual_clipped=dual,
    )


def log_space_clip_surrogate(
    log_ratio: torch.Tensor,
    advantages: torch.Tensor,
    positions: torch.Tensor,
    *,
    eps_low: float | torch.Tensor,
    eps_high: float | torch.Tensor,
    eps_c: float | None,
    power: float,
) -> SurrogateOut:
    """CTPO position-adaptive clip in log space. positions: Float[*T] n_t >= 1 (see ratios.unmasked_positions).
    eps_low / eps_high: numbers, or 0-d tensors (M2PO's bounds, chosen from the batch on the device)."""
    scale = positions.to(log_ratio.dtype) ** power if power != 0 else torch.ones_like(log_ratio)
    lo, hi = -eps_low * scale, eps_high * scale
    ratio = torch.exp(log_ratio)
    clipped_ratio = torch.exp(torch.minimum(torch.maximum(log_ratio, lo), hi))
    loss1, loss2 = -advantages * ratio, -advantages * clipped_ratio
    cap = None if eps_c is None else torch.exp(eps_c * scale)
    loss, dual = apply_dual_clip(max_unclipped_on_tie(loss1, loss2), advantages, cap)
    lr = log_ratio.detach()
    return SurrogateOut(
        loss=loss,
        ratio=ratio.detach(),
        clipped_ratio=clipped_ratio.detach(),
        clipped=(loss2 > loss1).detach(),
        clipped_low=(lr < lo) & (advantages < 0),
        clipped_high=(lr > hi) & (advantages > 0),
        dual_clipped=dual,
    )


def format_number(x: float | None) -> str:
    """A number as the config shows it (YAML's null for None)."""
    return "null" if x is None else f"{x:g}"


@register_objective
class PPOClip(PolicyObjective):
    name = "ppo_clip"
    keys = PPOClipKeys
    ratio_levels = get_args(RatioLevel)
    summary = "'ppo_clip' (PPO's ratio clip, NeMo-RL's; in ratio or log space, dual clip)"

    def surrogate(self, t: ObjectiveInputs) -> ObjectiveOut:
        cfg, keys, c, adv = t.config, PPOClipKeys.of(t.config), t.curr, t.advantages
        if t.causal_anchor is not None:  # the fused single pass: the cumulative value from the running sums
            log_r = straight_through_log_ratio(t.causal_anchor, c, keys.max_log_ratio)
        else:
            log_r = policy_log_ratio(
                cfg.effective_ratio_level,
                c,
                t.anchor,
                t.token_mask,
                t.layout,
                token_clamp=cfg.token_log_ratio_clamp,
                max_log_ratio=keys.max_log_ratio,
            )
        if uses_log_space_clip(cfg):
            low, high = keys.log_ratio_clip_low, keys.log_ratio_clip_high
            if low is None or high is None:  # the config refuses one without the other
                raise ValueError("log_ratio_clip_low and log_ratio_clip_high must be set together")
            sur = log_space_clip_surrogate(
                log_r,
                adv,
                t.positions,
                eps_low=low,
                eps_high=high,
                eps_c=keys.log_ratio_clip_c,
                power=keys.clip_position_power,
            )
            return ObjectiveOut(sur)
        return ObjectiveOut(
            ratio_clip_surrogate(
                log_r, adv, clip_low=cfg.ratio_clip_min, clip_high=cfg.ratio_clip_max, dual_clip=cfg.ratio_clip_c
            )
        )

    def differentiates_ratio(self, cfg: ObjectiveConfig) -> bool:
        return True  # the ratio- and log-space clips pass the unclipped exp(log r)'s gradient

    def whole_batch_reason(self, cfg: ObjectiveConfig) -> str | None:
        level = cfg.effective_ratio_level
        if level in ("token", *CAUSAL_LEVELS):
            return None
        return f"ratio_level={level!r} needs every log-prob of a sequence before any of its gradients"

    def causal(self, cfg: ObjectiveConfig) -> bool:
        return cfg.effective_ratio_level in CAUSAL_LEVELS

    def refusals(self, cfg: ObjectiveConfig) -> list[str]:
        keys, out = PPOClipKeys.of(cfg), []
        if (keys.log_ratio_clip_low is None) != (keys.log_ratio_clip_high is None):
            out.append(
                "log_ratio_clip_low and log_ratio_clip_high must be set together (CTPO defaults: 0.025 and 0.05)"
            )
        if uses_log_space_clip(cfg):
            if cfg.ratio_clip_c is not None:
                out.append("log-space clipping uses log_ratio_clip_c for the dual clip; set ratio_clip_c: null")
        elif keys.log_ratio_clip_c is not None:
            out.append("log_ratio_clip_c needs log_ratio_clip_low and log_ratio_clip_high")
        if keys.clip_position_power != 0.0 and not uses_log_space_clip(cfg):
            out.append("clip_position_power scales the log-space bounds; set log_ratio_clip_low/high as well")
        return out

    def score_centering_refusals(self, cfg: ObjectiveConfig) -> list[str]:
        return ratio_score_centering_refusals(cfg)

    def describe(self, cfg: ObjectiveConfig) -> str:
        keys, g = PPOClipKeys.of(cfg), format_number
        if uses_log_space_clip(cfg):
            p = keys.clip_position_power
            pos = f" * t^{g(p)}" if p != 0 else ""
            dual = f", dual clip exp({g(keys.log_ratio_clip_c)}{pos})" if keys.log_ratio_clip_c is not None else ""
            return f"log space [-{g(keys.log_ratio_clip_low)}{pos}, {g(keys.log_ratio_clip_high)}{pos}]{dual}"
        dual = f", dual clip c = {g(cfg.ratio_clip_c)}" if cfg.ratio_clip_c is not None else ", no dual clip"
        return f"ratio space [{g(1 - cfg.ratio_clip_min)}, {g(1 + cfg.ratio_clip_max)}]{dual}"


def ratio_score_centering_refusals(cfg: ObjectiveConfig) -> list[str]:
    """Score centering with a policy ratio (PPO's clip, CISPO's weight): not against mu (bypass mode)."""
    if not cfg.bypasses_prev:
        return []
    return [
        "score_centering with old_policy_logprobs='generation': the PPO ratio p/mu (and its clip) multiplies the "
        "sampled token's score, which f does not include: set disable_ppo_ratio: true (REINFORCE, verl's setting) or "
        "old_policy_logprobs: prev"
    ]


__all__ = [
    "CAUSAL_LEVELS",
    "PPOClip",
    "PPOClipKeys",
    "apply_dual_clip",
    "format_number",
    "log_space_clip_surrogate",
    "ratio_clip_surrogate",
    "ratio_score_centering_refusals",
    "uses_log_space_clip",
]
