"""Policy objectives beside PPO's clip: per-token surrogates (loss to minimise) for the divergence trust regions of
``trust_masks`` / ``prefix_budget``, SAPO's soft gate, GMPO's geometric mean, GPG and DRO.

c = current log-prob (requires grad), a = anchor (old) log-prob, d = c - a, r = exp(d), A = advantage, sg = detach.

===================  ======================================================================  ==========================
objective            per-token loss                                                           host name
===================  ======================================================================  ==========================
divergence PG        -A sg(min(r, cap)) c K           (K: a trust mask, cap: clip_ratio_c)     verl dppo_tv / dppo_kl
masked ratio         -A r K                                                                    prime-rl ipo, CPPO
SAPO                 -A f(r) with f(r) = sigmoid(tau (r - 1)) 4 / tau, tau = tau_pos if A > 0  verl sapo
                     else tau_neg
GMPO (per sequence)  -Abar_i exp(mean_t d~_t), d~ = A-sign-aware clip of d to [-eps_lo, eps_hi]  verl geo_mean
GPG                  -A c                                                                      verl gpg
DRO                  -(A c - beta / 2 d^2)                                                     verl dro
===================  ======================================================================  ==========================

Each returns a :class:`~nemo_is_plugin.loss.surrogate.SurrogateOut`, so the metrics that read PPO's clip indicators
read these too: ``clipped`` = the objective dropped or clipped the token (verl's ``pg_clipfrac``), ``clipped_high`` /
``clipped_low`` = that, split by advantage sign; ``dual_clipped`` = the ratio cap is active on a kept token (verl's
``pg_clipfrac_lower`` for the DPPO losses).
"""

from __future__ import annotations

import torch

from nemo_is_plugin.loss.layout import TokenLayout
from nemo_is_plugin.loss.masked import EPS, where_mask
from nemo_is_plugin.loss.surrogate import SurrogateOut, max_unclipped_on_tie
from nemo_is_plugin.loss.trust_masks import TrustMask


def _none(like: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(like, dtype=torch.bool)


def divergence_pg_surrogate(
    log_ratio: torch.Tensor, curr: torch.Tensor, advantages: torch.Tensor, mask: TrustMask, *, ratio_cap: float
) -> SurrogateOut:
    """DPPO's loss as verl writes it: -A sg(min(r, cap)) c on kept tokens. Its gradient is -A min(r, cap) grad c, the
    policy gradient of -A r truncated at ``cap`` (DPPO section 5.4 uses a large cap instead of a dual clip).

    Args:
        log_ratio: Float[*T] d, clamped by the caller (verl clamps at +-20). curr: Float[*T] c (requires grad).
        mask: the trust region (``binary_tv_mask`` / ``binary_kl_mask`` / ``probability_difference_mask`` / CPPO).
        ratio_cap: the truncation of the detached ratio (verl: ``clip_ratio_c``).
    """
    ratio = torch.exp(log_ratio).detach()
    weight = ratio.clamp(max=ratio_cap)
    keep = mask.keep.to(curr.dtype)
    loss = -advantages * weight * curr * keep
    return SurrogateOut(
        loss, ratio, weight, ~mask.keep, mask.masked_low, mask.masked_high, (ratio > ratio_cap) & mask.keep
    )


def masked_ratio_surrogate(log_ratio: torch.Tensor, advantages: torch.Tensor, mask: TrustMask) -> SurrogateOut:
    """-A r on kept tokens (prime-rl ``ipo``, CPPO): the ratio's own gradient, no truncation."""
    ratio = torch.exp(log_ratio)
    loss = -advantages * ratio * mask.keep.to(ratio.dtype)
    r = ratio.detach()
    return SurrogateOut(loss, r, r, ~mask.keep, mask.masked_low, mask.masked_high, _none(r))


def sapo_surrogate(log_ratio: torch.Tensor, advantages: torch.Tensor, *, tau_pos: float, tau_neg: float):
    """SAPO soft gate (arXiv 2511.20347; verl ``sapo``): -A sigmoid(tau (r - 1)) 4 / tau, tau by advantage sign.
    The gate's slope at r = 1 is 1, so near the anchor SAPO is the plain ratio objective; no token is dropped."""
    ratio = torch.exp(log_ratio)
    tau = torch.where(
        advantages > 0,
        torch.full_like(ratio, tau_pos),
        torch.full_like(ratio, tau_neg),
    )
    gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    r = ratio.detach()
    none = _none(r)
    return SurrogateOut(-gate * advantages, r, gate.detach(), none, none, none, none)


def gpg_surrogate(curr: torch.Tensor, advantages: torch.Tensor) -> SurrogateOut:
    """GPG (verl ``gpg``): -A c, no ratio at all; the reported ratio is the log-prob (as REINFORCE's)."""
    c = curr.detach()
    none = _none(c)
    return SurrogateOut(-advantages * curr, c, c, none, none, none, none)


def dro_surrogate(curr: torch.Tensor, anchor: torch.Tensor, advantages: torch.Tensor, *, beta: float) -> SurrogateOut:
    """DRO (verl ``dro``): -(A c - beta / 2 (c - a)^2); the quadratic term pulls the policy back to the anchor."""
    if not beta > 0:
        raise ValueError(f"DRO needs beta > 0 (verl policy_loss.dro_beta); got {beta}")
    d = curr - anchor
    loss = -(curr * advantages - 0.5 * beta * d * d)
    r = torch.exp(d.detach())
    none = _none(r)
    return SurrogateOut(loss, r, r, none, none, none, none)


def gmpo_surrogate(
    curr: torch.Tensor,
    anchor: torch.Tensor,
    advantages: torch.Tensor,
    token_mask: torch.Tensor,
    layout: TokenLayout,
    *,
    clip_low: float,
    clip_high: float,
) -> SurrogateOut:
    """GMPO (arXiv 2507.20673; verl ``geo_mean``): one ratio per sequence, the geometric mean of its token ratios.

    Per token, d is clipped to [-clip_low, clip_high] only on the side the advantage pushes (A > 0: from above,
    A < 0: from below; A = 0 tokens count log-ratio 0, as verl's sign(A) product gives). The sequence loss is
    -Abar_i exp(sum_t m d~_t / (n_i + 1e-8)), Abar_i the sequence's mean advantage. It is returned on every token of
    the sequence: aggregate it with ``seq-mean-token-mean`` (verl ignores ``loss_agg_mode`` and takes a plain mean
    over sequences). Sums go through the layout, so CP shards get the full-sequence value. The clip indicators are
    verl's: d outside [-clip_low, clip_high] with A > 0 (``clipped_high``) / A < 0 (``clipped_low``), whether or not
    the sign-aware clip moved it.
    """
    d = curr - anchor
    sign = torch.sign(advantages)
    clamped = d.clamp(-clip_low, clip_high)
    # sign min(sign d, sign clamped), a tie (d inside or on its bounds) going to d: see max_unclipped_on_tie
    d_tilde = -sign * max_unclipped_on_tie(-sign * d, -sign * clamped)
    mask = token_mask.to(d.dtype)
    count = layout.seq_sum(mask) + EPS
    seq_ratio = torch.exp(layout.seq_sum(where_mask(d_tilde, mask)) / count)
    seq_adv = layout.seq_sum(where_mask(advantages.to(d.dtype), mask)) / count
    loss = layout.to_tokens(-seq_adv * seq_ratio)
    clipped = (d != clamped).detach()
    r = torch.exp(d.detach())
    return SurrogateOut(
        loss,
        r,
        layout.to_tokens(seq_ratio.detach()),
        clipped & (advantages != 0),
        clipped & (advantages < 0),
        clipped & (advantages > 0),
        _none(r),
    )


__all__ = [
    "divergence_pg_surrogate",
    "dro_surrogate",
    "gmpo_surrogate",
    "gpg_surrogate",
    "masked_ratio_surrogate",
    "sapo_surrogate",
]
