"""Truncation, masking and rejection of IS weights: one vocabulary for what peers call TIS, IcePop, MIS, Geo-RS, veto.

Every function is pure and detached. ``low`` / ``high`` are bounds on the weight (ratio space); functions named
``*_log`` take the log-weight and compare in log space, so a weight that would overflow exp() is still truncated
correctly instead of becoming inf.

=============  =================================================================  ==============================
type           effect on the token weight w_t                                     peers
=============  =================================================================  ==============================
tis            clamp(w_t, low or 0, high)                                         TIS (Yao et al.), verl, slime
icepop         w_t * 1[low <= w_t <= high]                                        IcePop, OpenRLHF, NeMo-RL
seq-mask-tis   w_t * 1[low <= exp(mean_t x_t) <= high]                            NeMo-RL, OpenRLHF
seq-mis        w_t * 1[low <= exp(sum_t x_t) <= high]    (sequence rejection)     Seq-MIS (Liu & Li), verl
geo-rs         w_t * 1[low <= exp(mean_t x_t) <= high]   (rejection, w may be 1)  Geo-RS, verl, DeepSeek-V3.2
veto           w_t * 1[min_t w_t >= threshold]           (sequence rejection)     slime, verl's old veto
=============  =================================================================  ==============================
"""

from __future__ import annotations

import math

import torch


def _log(bound: float | None, default: float) -> float:
    if bound is None:
        return default
    return math.log(bound) if bound > 0 else float("-inf")


@torch.no_grad()
def tis(w: torch.Tensor, low: float | None, high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Truncate weights to ``[low or 0, high]``. Returns (truncated w, out-of-band bool mask)."""
    lo = 0.0 if low is None else low
    return w.clamp(lo, high), (w < lo) | (w > high)


@torch.no_grad()
def tis_log(log_w: torch.Tensor, low: float | None, high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`tis` computed in log space: exp(clamp(log w, log low, log high)); never overflows."""
    lo, hi = _log(low, float("-inf")), math.log(high)
    return torch.exp(log_w.clamp(lo, hi)), (log_w < lo) | (log_w > hi)


@torch.no_grad()
def band_mask(w: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """1[low <= w <= high] as a bool tensor (IcePop when applied per token, MIS when applied per sequence)."""
    return (w >= low) & (w <= high)


@torch.no_grad()
def band_mask_log(log_w: torch.Tensor, low: float | None, high: float) -> torch.Tensor:
    """:func:`band_mask` in log space (no lower edge when ``low`` is None)."""
    return (log_w >= _log(low, float("-inf"))) & (log_w <= math.log(high))


@torch.no_grad()
def veto_keep(min_token_log_w: torch.Tensor, threshold: float) -> torch.Tensor:
    """[S] bool: keep a sequence unless one of its token weights falls below ``threshold`` (min_t x_t < log thr)."""
    return min_token_log_w >= math.log(threshold)
