"""Per-token policy-gradient surrogates: PPO clip (ratio space), CTPO log-space clip with position-adaptive bounds,
dual clip, CISPO and REINFORCE. Each returns the per-token loss (to be minimised) and the clip indicators.

PPO clip:      L = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high));  dual clip (A < 0): L = min(L, -A c)
log-space:     L = max(-A r, -A exp(clamp(log r, -eps_low s_t, eps_high s_t)));  dual (A < 0): min(L, -A exp(eps_c s_t))
               with s_t = n_t ** power and n_t the 1-based position among unmasked tokens (CTPO; power 0 = fixed)
CISPO:         L = -A sg(clip(r, 1 - eps_low, 1 + eps_high)) log pi
REINFORCE:     L = -A log pi  (NeMo-RL disable_ppo_ratio: the "ratio" is the log-prob itself)
on-policy:     L = -A exp(c - sg[c])  (NeMo-RL force_on_policy_ratio: ratio 1 with its gradient, no clip)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SurrogateOut:
    """loss: Float[*T] per-token loss. ratio / clipped_ratio: Float[*T] (detached, for metrics).
    clipped / clipped_low / clipped_high / dual_clipped: Bool[*T] indicators (CTPO's definitions):
    clipped = the clipped branch is the larger loss; high = ratio above the upper bound with A > 0;
    low = ratio below the lower bound with A < 0; dual = the dual clip is active (A < 0)."""

    loss: torch.Tensor
    ratio: torch.Tensor
    clipped_ratio: torch.Tensor
    clipped: torch.Tensor
    clipped_low: torch.Tensor
    clipped_high: torch.Tensor
    dual_clipped: torch.Tensor


def max_unclipped_on_tie(unclipped: torch.Tensor, clipped: torch.Tensor) -> torch.Tensor:
    """max(unclipped, clipped), a tie going to the unclipped branch by explicit selection.

    The two tie wherever the ratio is inside its clip range or on a bound. On a bound the unclipped derivative is one
    of the loss's one-sided derivatives (its derivative where the bound is not a kink, e.g. the upper bound with
    A < 0); ``torch.maximum`` splits a tie evenly and the clipped branch then brings clamp's own tie rule (gradient 1
    up to torch 2.13, 0 from 2.15), which gave half the derivative at such a smooth point."""
    return torch.where(clipped > unclipped, clipped, unclipped)


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
    clip_low: float,
    clip_high: float,
    dual_clip: float | None = None,
) -> SurrogateOut:
    """PPO clip in ratio space. log_ratio, advantages: Float[*T]."""
    ratio = torch.exp(log_ratio)
    clipped_ratio = ratio.clamp(1 - clip_low, 1 + clip_high)
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
    eps_low: float,
    eps_high: float,
    eps_c: float | None,
    power: float,
) -> SurrogateOut:
    """CTPO position-adaptive clip in log space. positions: Float[*T] n_t >= 1 (see ratios.unmasked_positions)."""
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
