"""Divergence trust regions: which tokens may still push the policy, judged by a divergence between the current
policy pi and the anchor q (pi_old, or the rollout policy mu when the old log-probs are the rollout's: the plugin's
bypass setting). These masks replace PPO's ratio clip; the surrogates that use them are in ``objectives``.

p_t = exp(c_t), q_t = exp(a_t) (c: current log-prob, a: anchor log-prob), A: advantage, all per token.

==================  ===========================================================================  =====================
mask                keep token t when                                                             source
==================  ===========================================================================  =====================
Binary-TV           A > 0: p - q <= delta_high;  A <= 0: p - q >= -delta_low                      DPPO (2602.04879);
                                                                                                  verl ``dppo_tv``
Binary-KL           A > 0: KL_b <= delta_high or p <= q;  A <= 0: KL_b <= delta_low or p >= q     verl ``dppo_kl``
                    KL_b = q (a - c) + (1 - q) log((1 - q + 1e-8) / (1 - p + 1e-8))
prob. difference    |p - q| <= threshold (either advantage sign)                                  prime-rl ``ipo``
==================  ===========================================================================  =====================

The masks carry no gradient. The metric quadrants follow the advantage sign (``masked_high``: dropped with A > 0,
the probability rose too far; ``masked_low``: dropped with A <= 0), as verl's and prime-rl's masks branch on A > 0.
The masks are computed in the inputs' dtype, as verl does, so that a float32 batch takes the same decisions as verl.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# verl's guard inside the Binary-KL log (verl.trainer.ppo.core_algos.compute_policy_loss_dppo_kl).
BINARY_KL_EPS = 1e-8


@dataclass
class TrustMask:
    """keep: Bool[*T] tokens inside the trust region. masked_high / masked_low: Bool[*T] tokens dropped with A > 0 /
    with A <= 0 (disjoint; their union is ``~keep``). divergence: Float[*T] the divergence the rule thresholds."""

    keep: torch.Tensor
    masked_high: torch.Tensor
    masked_low: torch.Tensor
    divergence: torch.Tensor


def _split_by_sign(keep: torch.Tensor, advantages: torch.Tensor, divergence: torch.Tensor) -> TrustMask:
    positive = advantages > 0
    dropped = ~keep
    return TrustMask(keep, dropped & positive, dropped & ~positive, divergence)


@torch.no_grad()
def binary_tv_mask(
    curr: torch.Tensor, anchor: torch.Tensor, advantages: torch.Tensor, *, delta_low: float, delta_high: float
) -> TrustMask:
    """DPPO Binary-TV (verl ``dppo_tv``): the signed probability change p - q, bounded on the side the advantage pushes.

    Args:
        curr, anchor, advantages: Float[*T]. delta_low / delta_high: TV thresholds (verl: clip_ratio_low / _high).
    """
    diff = torch.exp(curr) - torch.exp(anchor)
    keep = torch.where(advantages > 0, diff <= delta_high, diff >= -delta_low)
    return _split_by_sign(keep, advantages, diff)


@torch.no_grad()
def binary_kl_mask(
    curr: torch.Tensor, anchor: torch.Tensor, advantages: torch.Tensor, *, delta_low: float, delta_high: float
) -> TrustMask:
    """DPPO Binary-KL (verl ``dppo_kl``): KL between the Bernoulli distributions (q, 1 - q) and (p, 1 - p), bounded
    only when the token moves the way the advantage pushes (up for A > 0, down for A <= 0)."""
    p, q = torch.exp(curr), torch.exp(anchor)
    kl = q * (anchor - curr) + (1 - q) * torch.log((1.0 - q + BINARY_KL_EPS) / (1.0 - p + BINARY_KL_EPS))
    keep = torch.where(advantages > 0, (kl <= delta_high) | (p <= q), (kl <= delta_low) | (p >= q))
    return _split_by_sign(keep, advantages, kl)


@torch.no_grad()
def probability_difference_mask(
    curr: torch.Tensor, anchor: torch.Tensor, advantages: torch.Tensor, *, threshold: float
) -> TrustMask:
    """prime-rl ``ipo`` (``loss.type="ipo"``, ``ipo_threshold``): drop a token whose probability moved more than
    ``threshold`` either way, whatever the advantage sign. ``advantages`` only splits the metric quadrants."""
    diff = torch.abs(torch.exp(curr) - torch.exp(anchor))
    return _split_by_sign(diff <= threshold, advantages, diff)


__all__ = ["BINARY_KL_EPS", "TrustMask", "binary_kl_mask", "binary_tv_mask", "probability_difference_mask"]
