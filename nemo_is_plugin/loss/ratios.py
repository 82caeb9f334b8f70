"""Policy ratios pi_theta / pi_old at each level, returned in log space with the gradient structure of each method.

Notation (token tensors of a :class:`~nemo_is_plugin.loss.layout.TokenLayout`): c = current log-probs (requires grad),
p = old (proximal) log-probs, m = token mask, d_t = c_t - p_t, sg = stop-gradient.

=================  ============================================================  ==========================
level              log r                                                           gradient flows to
=================  ============================================================  ==========================
token              d_t                                                             token t
sequence           sum_t m_t d_t / sum_t m_t                    (GSPO)             every token of the sequence
sequence_token     sg[sequence] + c_t - sg[c_t]                 (GSPO-token)       token t
cumulative         sg[sum_{j<=t} m_j d_j] + c_t - sg[c_t]       (CTPO cumprod)     token t
cumulative_mean    sg[sum_{j<=t} m_j d_j / n_t] + c_t - sg[c_t] (CTPO geomean)     token t
=================  ============================================================  ==========================

n_t = sum_{j<=t} m_j is the 1-based position among unmasked tokens (never below 1).
"""

from __future__ import annotations

import torch

from nemo_is_plugin.loss.layout import TokenLayout
from nemo_is_plugin.loss.masked import EPS, where_mask


@torch.no_grad()
def probability_change(curr: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
    """e^c_t - e^a_t, the signed change of the sampled token's probability (Float[*T] -> Float[*T]).

    Written once for every |p - q| of the package (prob_diff's and DPPO's Binary-TV masks, CPPO's divergence, the
    prob_diff rejection rule), with one dtype and one NaN rule:

    - at least float32 (float64 stays float64): a bf16 probability has 8 bits, too coarse for thresholds of a few
      hundredths near 1, and a bf16 prefix sum of |p - q| loses CPPO's budget to rounding (UniRL PR #58);
    - a NaN or +inf log-prob is no probability: the change counts 0 there. A -inf log-prob (a token outside the
      filtered sampling support) is probability 0, an exact value, and no log-ratio clamp is applied: the change is a
      bounded function of the two probabilities.
    """
    dtype = torch.promote_types(curr.dtype, torch.float32)
    d = torch.exp(curr.to(dtype)) - torch.exp(anchor.to(dtype))
    return torch.where(torch.isfinite(d), d, 0.0)


@torch.no_grad()
def probability_difference(curr: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
    """|e^c_t - e^a_t| in [0, 1]: the magnitude of :func:`probability_change` (its dtype and NaN rule)."""
    return probability_change(curr, anchor).abs()


def token_log_ratio(curr: torch.Tensor, prev: torch.Tensor, clamp: float | None = None) -> torch.Tensor:
    """d_t = c_t - p_t, optionally clamped to +-clamp (CTPO and verl clamp at 20 before exponentiating)."""
    d = curr - prev
    return d if clamp is None else d.clamp(-clamp, clamp)


def unmasked_positions(token_mask: torch.Tensor, layout: TokenLayout) -> torch.Tensor:
    """n_t: 1-based count of unmasked tokens up to and including t (at least 1). Float token tensor, no grad."""
    with torch.no_grad():
        return layout.prefix_sum((token_mask != 0).to(torch.float64)).clamp_min(1.0)


def sequence_mean_log_ratio(d: torch.Tensor, token_mask: torch.Tensor, layout: TokenLayout) -> torch.Tensor:
    """[S] per-sequence mean of d over unmasked tokens, with NeMo-RL's ``+1e-8`` denominator."""
    return layout.seq_sum(where_mask(d, token_mask)) / (layout.seq_sum(token_mask.to(d.dtype)) + EPS)


def policy_log_ratio(
    level: str,
    curr: torch.Tensor,
    prev: torch.Tensor,
    token_mask: torch.Tensor,
    layout: TokenLayout,
    *,
    token_clamp: float | None = None,
    max_log_ratio: float | None = None,
) -> torch.Tensor:
    """log of the policy ratio at ``level`` (see module table). All arguments are token tensors; returns one.

    Args:
        level: token | sequence | sequence_token | cumulative | cumulative_mean.
        curr: Float[*T] current log-probs (requires grad).
        prev: Float[*T] old log-probs (detached by the caller).
        token_mask: Float[*T] 1 on tokens that count.
        token_clamp: clamp of each d_t before aggregation.
        max_log_ratio: upper cap on the result (gradient 0 where capped), CTPO's ``min(., 10)``.
    """
    d = token_log_ratio(curr, prev, token_clamp)
    if level == "token":
        log_r = d
    elif level == "sequence":
        log_r = layout.to_tokens(sequence_mean_log_ratio(d, token_mask, layout))
    else:
        with torch.no_grad():
            if level == "sequence_token":
                anchor = layout.to_tokens(sequence_mean_log_ratio(d, token_mask, layout))
            elif level in ("cumulative", "cumulative_mean"):
                prefix = layout.prefix_sum(where_mask(d, token_mask))
                anchor = cumulative_anchor(level, prefix, unmasked_positions(token_mask, layout), token_mask)
            else:
                raise ValueError(f"unknown ratio level {level!r}")
        return straight_through_log_ratio(anchor, curr, max_log_ratio)
    return log_r if max_log_ratio is None else log_r.clamp(max=max_log_ratio)


def cumulative_anchor(
    level: str, prefix: torch.Tensor, positions: torch.Tensor, token_mask: torch.Tensor
) -> torch.Tensor:
    """Value of the cumulative log-ratio from the prefix sums ``sum_{j<=t} m_j d_j`` (``cumulative``) or their mean
    over ``n_t`` (``cumulative_mean``); 0 on masked tokens. All Float[*T], no grad."""
    anchor = prefix if level == "cumulative" else prefix / positions.to(prefix.dtype)
    return where_mask(anchor, token_mask)


def straight_through_log_ratio(
    anchor: torch.Tensor, curr: torch.Tensor, max_log_ratio: float | None = None
) -> torch.Tensor:
    """``anchor + c - sg[c]``: value ``anchor``, gradient d/dc_t of ``c_t`` only (only the current token is pushed);
    capped at ``max_log_ratio`` (gradient 0 where capped)."""
    log_r = anchor + curr - curr.detach()
    return log_r if max_log_ratio is None else log_r.clamp(max=max_log_ratio)
