"""``ppo_clip``: PPO's clipped surrogate and its variants, NeMo-RL's objective and the default.

The ratio r = pi / pi_old at ``ratio_level`` (token, GSPO's sequence and sequence_token, CTPO's cumulative and
cumulative_mean: :mod:`nemo_is_plugin.loss.ratios`), then:

PPO clip:      L = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high));  dual clip (A < 0): L = min(L, -A c)
log-space:     L = max(-A r, -A exp(clamp(log r, -eps_low s_t, eps_high s_t)));  dual (A < 0): min(L, -A exp(eps_c s_t))
               with s_t = n_t ** power and n_t the 1-based position among unmasked tokens (CTPO; power 0 = fixed)
CISPO:         L = -A sg(clip(r, 1 - eps_low, 1 + eps_high)) log pi
REINFORCE:     L = -A log pi  (NeMo-RL disable_ppo_ratio: the "ratio" is the log-prob itself)
on-policy:     L = -A exp(c - sg[c])  (NeMo-RL force_on_policy_ratio: ratio 1 with its gradient, no clip)

Keys: NeMo-RL's (``ratio_clip_min`` / ``_max`` / ``_c``, ``use_cispo``, ``disable_ppo_ratio``,
``force_on_policy_ratio``) stay in NeMo-RL's block of ``config/keys.py``: they are NeMo-RL's schema, kept whole, and
the loss's assembly reads the last two (which old log-probs the IS weights compare; whether the fused loss can take a
single pass). This module's section holds the plugin's own clip keys (CTPO's log-space clip and the log-ratio cap).
Every other objective replaces this clip: its keys and switches are refused with another objective
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
    max_unclipped_on_tie,
    register_objective,
)
from nemo_is_plugin.loss.ratios import policy_log_ratio, straight_through_log_ratio

if TYPE_CHECKING:
    from nemo_is_plugin.loss.config_model import ClippedPGLossConfig

CAUSAL_LEVELS = ("cumulative", "cumulative_mean")
# PPO's clip keys and ratio switches, which every other objective replaces by its own trust region or gate.
NEMO_RL_CLIP_KEYS = ("ratio_clip_min", "ratio_clip_max", "ratio_clip_c")
RATIO_SWITCHES = ("use_cispo", "disable_ppo_ratio", "force_on_policy_ratio", "sequence_level_importance_ratios")


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
        """Another objective replaces PPO's clip: its clip keys and the switches that choose another ratio are
        refused with it."""
        out = [
            f"{key} configures PPO's ratio clip, which policy_objective={chosen!r} replaces with its own trust "
            f"region: unset {key} (or use policy_objective: ppo_clip)"
            for key in (*NEMO_RL_CLIP_KEYS, *cls.own_keys())
            if getattr(cfg, key) != type(cfg).model_fields[key].default
        ]
        out += [
            f"{key}=true chooses another policy ratio than policy_objective={chosen!r}'s: set it false"
            for key in RATIO_SWITCHES
            if getattr(cfg, key)
        ]
        return out


def uses_log_space_clip(cfg: ClippedPGLossConfig) -> bool:
    keys = PPOClipKeys.of(cfg)
    return keys.log_ratio_clip_low is not None or keys.log_ratio_clip_high is not None


def _dual_clip(loss: torch.Tensor, advantages: torch.Tensor, cap: torch.Tensor | float | None):
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
    loss, dual = _dual_clip(max_unclipped_on_tie(loss1, loss2), advantages, dual_clip)
    r = ratio.detach()
    return SurrogateOut(
        loss,
        r,
        clipped_ratio.detach(),
        (loss2 > loss1).detach(),
        (r < 1 - clip_low) & (advantages < 0),
        (r > 1 + clip_high) & (advantages > 0),
        dual,
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
    loss, dual = _dual_clip(max_unclipped_on_tie(loss1, loss2), advantages, cap)
    lr = log_ratio.detach()
    return SurrogateOut(
        loss,
        ratio.detach(),
        clipped_ratio.detach(),
        (loss2 > loss1).detach(),
        (lr < lo) & (advantages < 0),
        (lr > hi) & (advantages > 0),
        dual,
    )


def cispo_surrogate(
    log_ratio: torch.Tensor, curr: torch.Tensor, advantages: torch.Tensor, *, clip_low: float, clip_high: float
) -> SurrogateOut:
    """CISPO: -A sg(clip(r)) log pi; the clipped weight carries no gradient, the log-prob does."""
    ratio = torch.exp(log_ratio)
    clipped_ratio = ratio.clamp(1 - clip_low, 1 + clip_high)
    loss = -advantages * clipped_ratio.detach() * curr
    r = ratio.detach()
    none = torch.zeros_like(r, dtype=torch.bool)
    return SurrogateOut(
        loss,
        r,
        clipped_ratio.detach(),
        (r != clipped_ratio.detach()),
        (r < 1 - clip_low) & (advantages < 0),
        (r > 1 + clip_high) & (advantages > 0),
        none,
    )


def on_policy_surrogate(curr: torch.Tensor, advantages: torch.Tensor, *, dual_clip: float | None) -> SurrogateOut:
    """NeMo-RL ``force_on_policy_ratio``: r = exp(c - sg[c]) (value 1, gradient grad c), never clipped: L = -A r;
    the dual clip still applies."""
    ratio = torch.exp(curr - curr.detach())
    loss, dual = _dual_clip(-advantages * ratio, advantages, dual_clip)
    r = ratio.detach()
    none = torch.zeros_like(r, dtype=torch.bool)
    return SurrogateOut(loss, r, r, none, none, none, dual)


def reinforce_surrogate(curr: torch.Tensor, advantages: torch.Tensor, *, dual_clip: float | None) -> SurrogateOut:
    """NeMo-RL ``disable_ppo_ratio``: L = -A log pi; the reported 'ratio' is the log-prob; dual clip still applies."""
    loss, dual = _dual_clip(-advantages * curr, advantages, dual_clip)
    c = curr.detach()
    none = torch.zeros_like(c, dtype=torch.bool)
    return SurrogateOut(loss, c, c, none, none, none, dual)


def _g(x: float | None) -> str:
    return "null" if x is None else f"{x:g}"


@register_objective
class PPOClip(PolicyObjective):
    name = "ppo_clip"
    keys = PPOClipKeys
    ratio_levels = get_args(RatioLevel)
    summary = "'ppo_clip' (PPO's ratio clip, NeMo-RL's; CISPO, dual clip, REINFORCE and on-policy variants)"

    def surrogate(self, t: ObjectiveInputs) -> ObjectiveOut:
        cfg, keys, c, adv = t.config, PPOClipKeys.of(t.config), t.curr, t.advantages
        # NeMo-RL tests force_on_policy_ratio first: with disable_ppo_ratio as well, the ratio is still exp(c - sg c).
        if cfg.force_on_policy_ratio and not uses_log_space_clip(cfg):
            return ObjectiveOut(on_policy_surrogate(c, adv, dual_clip=cfg.ratio_clip_c))
        if cfg.disable_ppo_ratio:
            return ObjectiveOut(reinforce_surrogate(c, adv, dual_clip=cfg.ratio_clip_c))
        if cfg.force_on_policy_ratio:
            log_r = c - c.detach()
        elif t.causal_anchor is not None:  # the fused single pass: the cumulative value from the running sums
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
        if cfg.use_cispo:
            return ObjectiveOut(
                cispo_surrogate(log_r, c, adv, clip_low=cfg.ratio_clip_min, clip_high=cfg.ratio_clip_max)
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

    def differentiates_ratio(self, cfg: ClippedPGLossConfig) -> bool:
        # the ratio- and log-space clips pass the unclipped exp(log r)'s gradient; CISPO stops it, REINFORCE and the
        # on-policy ratio exp(c - sg c) have none that can overflow
        return not (cfg.use_cispo or cfg.disable_ppo_ratio or cfg.force_on_policy_ratio)

    def whole_batch_reason(self, cfg: ClippedPGLossConfig) -> str | None:
        level = cfg.effective_ratio_level
        if cfg.disable_ppo_ratio or level in ("token", *CAUSAL_LEVELS):
            return None
        return f"ratio_level={level!r} needs every log-prob of a sequence before any of its gradients"

    def causal(self, cfg: ClippedPGLossConfig) -> bool:
        return not cfg.disable_ppo_ratio and cfg.effective_ratio_level in CAUSAL_LEVELS

    def refusals(self, cfg: ClippedPGLossConfig) -> list[str]:
        keys, out = PPOClipKeys.of(cfg), []
        if cfg.use_cispo:
            for flag, bad in (
                ("disable_ppo_ratio", cfg.disable_ppo_ratio),
                ("force_on_policy_ratio", cfg.force_on_policy_ratio),
                ("sequence_level_importance_ratios", cfg.sequence_level_importance_ratios),
            ):
                if bad:
                    out.append(f"use_cispo=true is incompatible with {flag}=true; turn one of them off")
            if cfg.ratio_clip_c is not None:
                out.append("use_cispo=true is incompatible with ratio_clip_c (dual clip); set ratio_clip_c: null")
            if not cfg.token_level_loss:
                out.append("use_cispo=true requires token_level_loss=true")
            if cfg.ratio_level not in (None, "token"):
                out.append(f"use_cispo=true uses the token ratio; ratio_level={cfg.ratio_level!r} is not allowed")
            if uses_log_space_clip(cfg):
                out.append("use_cispo=true clips in ratio space; unset log_ratio_clip_low/high")
        if cfg.disable_ppo_ratio and cfg.ratio_level not in (None, "token"):
            out.append(f"disable_ppo_ratio=true has no ratio; ratio_level={cfg.ratio_level!r} must be unset")
        if cfg.force_on_policy_ratio and cfg.ratio_level not in (None, "token", "sequence"):
            out.append(
                f"force_on_policy_ratio=true fixes the ratio to 1; ratio_level={cfg.ratio_level!r} must be unset"
            )
        if (keys.log_ratio_clip_low is None) != (keys.log_ratio_clip_high is None):
            out.append(
                "log_ratio_clip_low and log_ratio_clip_high must be set together (CTPO defaults: 0.025 and 0.05)"
            )
        if uses_log_space_clip(cfg):
            if cfg.ratio_clip_c is not None:
                out.append("log-space clipping uses log_ratio_clip_c for the dual clip; set ratio_clip_c: null")
            if cfg.disable_ppo_ratio:
                out.append("log_ratio_clip_low/high need a policy ratio; disable_ppo_ratio must be false")
        elif keys.log_ratio_clip_c is not None:
            out.append("log_ratio_clip_c needs log_ratio_clip_low and log_ratio_clip_high")
        if keys.clip_position_power != 0.0 and not uses_log_space_clip(cfg):
            out.append("clip_position_power scales the log-space bounds; set log_ratio_clip_low/high as well")
        if keys.max_log_ratio is not None and cfg.disable_ppo_ratio:
            out.append("max_log_ratio caps the policy ratio; disable_ppo_ratio must be false")
        return out

    def describe(self, cfg: ClippedPGLossConfig) -> str:
        keys = PPOClipKeys.of(cfg)
        if cfg.disable_ppo_ratio:
            dual = f", dual clip c = {_g(cfg.ratio_clip_c)}" if cfg.ratio_clip_c is not None else ""
            return "none" + dual
        if cfg.use_cispo:
            return (
                f"CISPO: stop-gradient weight clamp(r, {_g(1 - cfg.ratio_clip_min)}, {_g(1 + cfg.ratio_clip_max)}) "
                "times -A * log pi"
            )
        if uses_log_space_clip(cfg):
            p = keys.clip_position_power
            pos = f" * t^{_g(p)}" if p != 0 else ""
            dual = f", dual clip exp({_g(keys.log_ratio_clip_c)}{pos})" if keys.log_ratio_clip_c is not None else ""
            return f"log space [-{_g(keys.log_ratio_clip_low)}{pos}, {_g(keys.log_ratio_clip_high)}{pos}]{dual}"
        dual = f", dual clip c = {_g(cfg.ratio_clip_c)}" if cfg.ratio_clip_c is not None else ", no dual clip"
        return f"ratio space [{_g(1 - cfg.ratio_clip_min)}, {_g(1 + cfg.ratio_clip_max)}]{dual}"

    def describe_ratio(self, cfg: ClippedPGLossConfig) -> str | None:
        if cfg.disable_ppo_ratio:
            return "none: REINFORCE surrogate -A * log pi (disable_ppo_ratio)"
        if cfg.force_on_policy_ratio:
            return "fixed to 1 with the policy gradient (force_on_policy_ratio)"
        return None


__all__ = [
    "CAUSAL_LEVELS",
    "PPOClip",
    "PPOClipKeys",
    "cispo_surrogate",
    "log_space_clip_surrogate",
    "on_policy_surrogate",
    "ratio_clip_surrogate",
    "reinforce_surrogate",
    "uses_log_space_clip",
]
