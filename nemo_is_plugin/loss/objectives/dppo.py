"""``dppo_tv`` / ``dppo_kl``: DPPO's divergence trust regions (arXiv 2602.04879; verl ``dppo_tv`` / ``dppo_kl``).

p_t = exp(c_t), q_t = exp(a_t) (c: current log-prob, a: anchor log-prob), A: advantage, all per token.

==========  ===========================================================================
mask        keep token t when
==========  ===========================================================================
Binary-TV   A > 0: p - q <= delta_high;  A <= 0: p - q >= -delta_low
Binary-KL   A > 0: KL_b <= delta_high or p <= q;  A <= 0: KL_b <= delta_low or p >= q
            KL_b = q (a - c) + (1 - q) log((1 - q + 1e-8) / (1 - p + 1e-8))
==========  ===========================================================================

Loss on kept tokens: -A sg(min(r, C)) c, r = exp(clamp(c - a, +-20)), C = ``dppo_ratio_cap`` (verl: ``clip_ratio_c``).
The masks carry no gradient and are computed in the inputs' dtype, as verl does, so that a float32 batch takes the
same decisions as verl. Indicators: ``clipped`` = dropped (verl's ``pg_clipfrac``), split by advantage sign;
``dual_clipped`` = a kept token whose ratio exceeds the cap (verl's ``pg_clipfrac_lower``). Source: verl-project/verl
``verl/trainer/ppo/core_algos.py`` ``compute_policy_loss_dppo_tv`` / ``_kl`` @ 1dda039b9c6311889a9c9a26040677e1254814f9.
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
    TrustMask,
    register_objective,
    split_by_sign,
)
from nemo_is_plugin.loss.ratios import probability_change

if TYPE_CHECKING:
    from nemo_is_plugin.loss.objectives.config_view import ObjectiveConfig

# verl's guard inside the Binary-KL log (verl.trainer.ppo.core_algos.compute_policy_loss_dppo_kl).
BINARY_KL_EPS = 1e-8


class DppoKeys(KeySection):
    """DPPO's thresholds (verl's ``clip_ratio_low`` / ``_high`` under ``dppo_tv`` / ``dppo_kl``) and ratio cap."""

    dppo_delta_low: Annotated[
        float | None,
        NumericRange(
            low=0.0,
            low_open=True,
            why="the DPPO threshold on the divergence of a token with A <= 0 (TV: q - p, KL: the binary KL); 0 or "
            "less drops every token that moved at all",
            fix="use e.g. 0.2 (verl's clip_ratio_low under loss_mode dppo_tv)",
        ),
    ] = Field(None, description="DPPO threshold for A <= 0 (dppo_tv / dppo_kl; required there).")
    dppo_delta_high: Annotated[
        float | None,
        NumericRange(
            low=0.0,
            low_open=True,
            why="the DPPO threshold on the divergence of a token with A > 0 (TV: p - q, KL: the binary KL); 0 or "
            "less drops every token that moved at all",
            fix="use e.g. 0.28 (verl's clip_ratio_high under loss_mode dppo_tv)",
        ),
    ] = Field(None, description="DPPO threshold for A > 0 (dppo_tv / dppo_kl; required there).")
    dppo_ratio_cap: Annotated[
        float,
        NumericRange(
            low=1.0,
            why="DPPO's gradient weight is min(r, cap) on kept tokens; a cap below 1 also shrinks the weight of "
            "unchanged tokens (r = 1), a learning-rate cut rather than a cap",
            fix="use 20 (DPPO; verl's dict default) or 3 (verl's ActorConfig clip_ratio_c)",
        ),
    ] = Field(20.0, description="Cap C of DPPO's detached ratio weight min(r, C) (verl: clip_ratio_c).")


@torch.no_grad()
def binary_tv_mask(
    curr: torch.Tensor, anchor: torch.Tensor, advantages: torch.Tensor, *, delta_low: float, delta_high: float
) -> TrustMask:
    """DPPO Binary-TV: the signed probability change p - q, bounded on the side the advantage pushes.

    Args:
        curr, anchor, advantages: Float[*T]. delta_low / delta_high: TV thresholds (verl: clip_ratio_low / _high).
    """
    diff = probability_change(curr, anchor)
    keep = torch.where(advantages > 0, diff <= delta_high, diff >= -delta_low)
    return split_by_sign(keep, advantages, diff)


@torch.no_grad()
def binary_kl_mask(
    curr: torch.Tensor, anchor: torch.Tensor, advantages: torch.Tensor, *, delta_low: float, delta_high: float
) -> TrustMask:
    """DPPO Binary-KL: KL between the Bernoulli distributions (q, 1 - q) and (p, 1 - p), bounded only when the token
    moves the way the advantage pushes (up for A > 0, down for A <= 0)."""
    p, q = torch.exp(curr), torch.exp(anchor)
    kl = q * (anchor - curr) + (1 - q) * torch.log((1.0 - q + BINARY_KL_EPS) / (1.0 - p + BINARY_KL_EPS))
    keep = torch.where(advantages > 0, (kl <= delta_high) | (p <= q), (kl <= delta_low) | (p >= q))
    return split_by_sign(keep, advantages, kl)


def divergence_pg_surrogate(
    log_ratio: torch.Tensor, curr: torch.Tensor, advantages: torch.Tensor, mask: TrustMask, *, ratio_cap: float
) -> SurrogateOut:
    """DPPO's loss as verl writes it: -A sg(min(r, cap)) c on kept tokens. Its gradient is -A min(r, cap) grad c, the
    policy gradient of -A r truncated at ``cap`` (DPPO section 5.4 uses a large cap instead of a dual clip).

    Args:
        log_ratio: Float[*T] d, clamped by the caller (verl clamps at +-20). curr: Float[*T] c (requires grad).
        mask: the trust region (``binary_tv_mask`` / ``binary_kl_mask``).
        ratio_cap: the truncation of the detached ratio (verl: ``clip_ratio_c``).
    """
    ratio = torch.exp(log_ratio).detach()
    weight = ratio.clamp(max=ratio_cap)
    keep = mask.keep.to(curr.dtype)
    loss = -advantages * weight * curr * keep
    return SurrogateOut(
        loss=loss,
        ratio=ratio,
        clipped_ratio=weight,
        clipped=~mask.keep,
        clipped_low=mask.masked_low,
        clipped_high=mask.masked_high,
        dual_clipped=(ratio > ratio_cap) & mask.keep,
    )


def _g(x: float | None) -> str:
    return "null" if x is None else f"{x:g}"


class _Dppo(TokenRatioObjective):
    keys = DppoKeys
    required = ("dppo_delta_low", "dppo_delta_high")
    rule = staticmethod(binary_tv_mask)
    divergence = "p - q"

    def surrogate(self, t: ObjectiveInputs) -> ObjectiveOut:
        keys = DppoKeys.of(t.config)
        if keys.dppo_delta_low is None or keys.dppo_delta_high is None:  # refused by the config (required keys)
            raise ValueError(f"policy_objective={self.name!r} needs dppo_delta_low and dppo_delta_high")
        trust = self.rule(
            t.curr.detach(), t.anchor, t.advantages, delta_low=keys.dppo_delta_low, delta_high=keys.dppo_delta_high
        )
        sur = divergence_pg_surrogate(t.token_log_ratio(), t.curr, t.advantages, trust, ratio_cap=keys.dppo_ratio_cap)
        return ObjectiveOut(sur)

    def describe(self, cfg: ObjectiveConfig) -> str:
        keys = DppoKeys.of(cfg)
        return (
            f"{self.name}: drop a token whose {self.divergence} exceeds {_g(keys.dppo_delta_high)} (A > 0) / "
            f"{_g(keys.dppo_delta_low)} (A <= 0) in the advantage's direction; loss -A sg(min(r, "
            f"{_g(keys.dppo_ratio_cap)})) log pi"
        )


@register_objective
class DppoTV(_Dppo):
    name = "dppo_tv"
    summary = "'dppo_tv' (DPPO binary TV mask)"


@register_objective
class DppoKL(_Dppo):
    name = "dppo_kl"
    summary = "'dppo_kl' (DPPO binary KL mask)"
    rule = staticmethod(binary_kl_mask)
    divergence = "binary KL(q, p)"


__all__ = [
    "BINARY_KL_EPS",
    "DppoKL",
    "DppoKeys",
    "DppoTV",
    "binary_kl_mask",
    "binary_tv_mask",
    "divergence_pg_surrogate",
]
