"""Closed-form derivatives w.r.t. the current log-prob ``c`` of the per-token loss pieces (surrogates, KL penalty).

Each function mirrors its twin in :mod:`nemo_is_plugin.loss.surrogate` / :mod:`nemo_is_plugin.loss.kl` op by op and
carries a :class:`Dual` ``(value, d value / d c)`` through the same expressions (forward-mode differentiation written
out), so the values that decide a branch (which side of a clip, which loss is larger) are bit-identical to the loss's,
and each kink follows autograd's convention exactly:

- ``clamp``: the derivative passes on the closed interval ``lo <= x <= hi`` (boundaries included);
- ``maximum(a, b)`` / ``minimum(a, b)``: the larger (smaller) side takes it; on a tie each side takes half;
- ``where``: the selected side only; ``nan_to_num``: 0 where its input is not finite.

Derivatives of the pieces (x = c - p clamped and capped: ``dx`` is 0 or 1; A advantage; r = exp(log r)):

    PPO ratio clip   d/dc max(-A r, -A clip(r)) = -A r dx  on the side that wins (half each on a tie)
    log-space clip   the same with clip(r) = exp(min(max(log r, lo_t), hi_t))
    dual clip        min(L, -A cap) for A < 0: dL where L wins
    CISPO            -A sg(clip(r)) c                     -> -A clip(r)
    REINFORCE        -A c                                 -> -A
    KL (logr = ref - c, weight w(c)):  k1 -> -1,  k2 -> logr (-1),  k3 -> (e^logr - 1)(-1), times w, plus w' k;
    the straight-through k2 keeps the value and takes k2's derivative; the clamps as above.

All tensors are ``[n]`` (one chunk's tokens), in the loss arithmetic's dtype (fp32, or fp64).
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class Dual(NamedTuple):
    """A value and its derivative w.r.t. ``c`` (both ``[n]``)."""

    v: torch.Tensor
    d: torch.Tensor


def d_exp(x: Dual) -> Dual:
    e = torch.exp(x.v)
    return Dual(e, e * x.d)


def d_clamp(x: Dual, lo: float | None = None, hi: float | None = None) -> Dual:
    """``x.clamp(lo, hi)``; at least one bound is given."""
    if lo is not None and hi is not None:
        keep = (x.v >= lo) & (x.v <= hi)
    elif lo is not None:
        keep = x.v >= lo
    elif hi is not None:
        keep = x.v <= hi
    else:
        raise ValueError("d_clamp needs a lower or an upper bound")
    return Dual(x.v.clamp(lo, hi), torch.where(keep, x.d, 0.0))


def _share(x: torch.Tensor, other: torch.Tensor, losing: torch.Tensor) -> torch.Tensor:
    """autograd's weight of ``x`` in ``maximum`` / ``minimum(x, other)``: 1, 1/2 on a tie, 0 where it loses."""
    return torch.where(x == other, 0.5, 1.0).masked_fill_(losing, 0.0)


def d_maximum(a: Dual, b: Dual) -> Dual:
    wa, wb = _share(a.v, b.v, a.v < b.v), _share(b.v, a.v, a.v > b.v)
    return Dual(torch.maximum(a.v, b.v), wa * a.d + wb * b.d)


def d_maximum_const(a: Dual, b: torch.Tensor) -> Dual:
    return Dual(torch.maximum(a.v, b), _share(a.v, b, a.v < b) * a.d)


def d_minimum_const(a: Dual, b: torch.Tensor) -> Dual:
    return Dual(torch.minimum(a.v, b), _share(a.v, b, a.v > b) * a.d)


def d_neg_mul(a: torch.Tensor, x: Dual) -> Dual:
    """``-a * x`` (``-advantages * ratio`` in the surrogates)."""
    na = -a
    return Dual(na * x.v, na * x.d)


# ------------------------------------------------------------------------------------------------ policy log-ratio
def token_log_ratio_d(c: torch.Tensor, prev: torch.Tensor, clamp: float | None, max_log_ratio: float | None) -> Dual:
    """``ratios.policy_log_ratio`` at the token level: ``clamp(c - p, +-clamp)`` capped at ``max_log_ratio``."""
    x = Dual(c - prev, torch.ones_like(c))
    if clamp is not None:
        x = d_clamp(x, -clamp, clamp)
    return x if max_log_ratio is None else d_clamp(x, None, max_log_ratio)


def straight_through_log_ratio_d(anchor: torch.Tensor, c: torch.Tensor, max_log_ratio: float | None) -> Dual:
    """``ratios.straight_through_log_ratio``: value ``anchor + c - sg[c]``, derivative 1, capped."""
    x = Dual(anchor + c - c, torch.ones_like(c))
    return x if max_log_ratio is None else d_clamp(x, None, max_log_ratio)


# ------------------------------------------------------------------------------------------------ surrogates
def dual_clip_d(loss: Dual, adv: torch.Tensor, cap) -> Dual:
    """``surrogate._dual_clip``: ``min(loss, -A cap)`` where ``A < 0``."""
    if cap is None:
        return loss
    capped = d_minimum_const(loss, -adv * cap)
    neg = adv < 0
    return Dual(torch.where(neg, capped.v, loss.v), torch.where(neg, capped.d, loss.d))


def ratio_clip_d(
    log_ratio: Dual, adv: torch.Tensor, *, clip_low: float, clip_high: float, dual_clip: float | None
) -> Dual:
    """``surrogate.ratio_clip_surrogate``'s loss."""
    ratio = d_exp(log_ratio)
    clipped = d_clamp(ratio, 1 - clip_low, 1 + clip_high)
    return dual_clip_d(d_maximum(d_neg_mul(adv, ratio), d_neg_mul(adv, clipped)), adv, dual_clip)


def log_space_clip_d(
    log_ratio: Dual,
    adv: torch.Tensor,
    positions: torch.Tensor,
    *,
    eps_low: float,
    eps_high: float,
    eps_c: float | None,
    power: float,
) -> Dual:
    """``surrogate.log_space_clip_surrogate``'s loss."""
    scale = positions.to(log_ratio.v.dtype) ** power if power != 0 else torch.ones_like(log_ratio.v)
    lo, hi = -eps_low * scale, eps_high * scale
    ratio = d_exp(log_ratio)
    clipped = d_exp(d_minimum_const(d_maximum_const(log_ratio, lo), hi))
    cap = None if eps_c is None else torch.exp(eps_c * scale)
    return dual_clip_d(d_maximum(d_neg_mul(adv, ratio), d_neg_mul(adv, clipped)), adv, cap)


def cispo_d(log_ratio: Dual, adv: torch.Tensor, *, clip_low: float, clip_high: float) -> torch.Tensor:
    """Derivative of ``surrogate.cispo_surrogate``'s loss ``-A sg(clip(r)) c``: ``-A clip(r)``."""
    return -adv * torch.exp(log_ratio.v).clamp(1 - clip_low, 1 + clip_high)


def reinforce_d(c: torch.Tensor, adv: torch.Tensor, *, dual_clip: float | None) -> torch.Tensor:
    """Derivative of ``surrogate.reinforce_surrogate``'s loss ``-A c`` (dual clip included)."""
    return dual_clip_d(d_neg_mul(adv, Dual(c, torch.ones_like(c))), adv, dual_clip).d


# ------------------------------------------------------------------------------------------------ KL penalty
def _estimate_d(logr: Dual, kl_type: str) -> Dual:
    if kl_type == "k1":
        return Dual(-logr.v, -logr.d)
    if kl_type == "k2":
        return Dual(torch.square(logr.v) / 2, logr.v * logr.d)
    if kl_type == "k3":
        e = torch.exp(logr.v)
        return Dual(e - 1 - logr.v, (e - 1) * logr.d)
    raise ValueError(f"reference_policy_kl_type must be one of k1, k2, k3, got {kl_type!r}")


def score_function_weight_d(c: torch.Tensor) -> Dual:
    """``kl.score_function_weight``: ``nan_to_num(exp(c - sg[c]))``: value 1, derivative 1 (0 where not finite)."""
    e = torch.exp(c - c)
    ok = torch.isfinite(e)
    return Dual(torch.where(ok, e, 0.0), torch.where(ok, e, 0.0))


def exp_or_zero_d(log_w: torch.Tensor) -> Dual:
    """``is_weights.exp_or_zero`` of ``log_w = c - g`` (derivative of ``log_w`` w.r.t. ``c``: 1)."""
    ok = torch.isfinite(log_w) & (log_w < torch.finfo(log_w.dtype).max) & torch.exp(log_w).isfinite()
    value = torch.where(ok, torch.exp(torch.where(ok, log_w, 0.0)), 0.0)
    return Dual(value, value)


def kl_penalty_d(
    c: torch.Tensor,
    ref: torch.Tensor,
    weight: Dual,
    *,
    kl_type: str,
    input_clamp: float | None,
    output_clamp: float | None,
    straight_through_k2: bool,
) -> torch.Tensor:
    """Derivative of ``kl.kl_penalty(c, ref, weights=w)`` w.r.t. ``c``."""
    logr = Dual(ref - c, torch.full_like(c, -1.0))
    w = weight
    if input_clamp is not None:
        active = (logr.v < -input_clamp) | (logr.v > input_clamp)
        logr = d_clamp(logr, -input_clamp, input_clamp)
        w = Dual(w.v, torch.where(active, 0.0, w.d))
    est = _estimate_d(logr, kl_type)
    kl = Dual(w.v * est.v, w.d * est.v + w.v * est.d)
    if straight_through_k2:
        k2 = _estimate_d(logr, "k2")
        kl = Dual(k2.v + (kl.v - k2.v), k2.d)
    if output_clamp is not None:
        kl = d_clamp(kl, -output_clamp, output_clamp)
    return kl.d


__all__ = [
    "Dual",
    "cispo_d",
    "d_clamp",
    "d_exp",
    "d_maximum",
    "d_maximum_const",
    "d_minimum_const",
    "dual_clip_d",
    "exp_or_zero_d",
    "kl_penalty_d",
    "log_space_clip_d",
    "ratio_clip_d",
    "reinforce_d",
    "score_function_weight_d",
    "straight_through_log_ratio_d",
    "token_log_ratio_d",
]
