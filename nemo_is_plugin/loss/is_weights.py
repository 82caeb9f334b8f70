"""Importance-sampling weights pi_prev / pi_gen that correct the training/rollout mismatch, at four levels.

Notation: p = training-engine (prev) log-probs, g = rollout-engine (generation) log-probs, x_t = p_t - g_t,
m = token mask, L = sum_t m_t. All weights are detached: they reweight the gradient, they are not optimised.

==============  ==================================  ==============================================================
level           log w                               note
==============  ==================================  ==============================================================
token           x_t                                 biased (ignores the prefix) but low variance
sequence        sum_t m_t x_t                       unbiased; variance grows like (1+chi2)^L, collapses when long
sequence_mean   sum_t m_t x_t / L                   geometric mean (NeMo-RL PR #2269); stable at any length
cumulative      sum_{j<=t} m_j x_j                  unbiased prefix correction (CTPO Prop. 1 applied to pi_prev/mu)
==============  ==================================  ==============================================================

A token whose generation log-prob is not finite (vLLM reports -inf for a token its sampler filtered) has no ratio:
x_t = +inf (or NaN). NeMo-RL's rule, exp of the log-sum then ``nan_to_num``, gives weight 0 to every weight whose
log-sum contains that term; the explicit levels keep that rule (:func:`unmeasured_weights`) while computing the
other weights from finite terms only (``correction.py``).
"""

from __future__ import annotations

import torch

from nemo_is_plugin.loss.layout import TokenLayout
from nemo_is_plugin.loss.masked import where_mask

IS_LEVELS = ("token", "sequence", "sequence_mean", "cumulative")


@torch.no_grad()
def is_log_weight(
    level: str, prev: torch.Tensor, gen: torch.Tensor, token_mask: torch.Tensor, layout: TokenLayout
) -> torch.Tensor:
    """log w at ``level`` as a token tensor (sequence levels are broadcast to every token of the sequence).

    Args:
        level: token | sequence | sequence_mean | cumulative.
        prev, gen: Float[*T] log-probs of the training and rollout engines.
        token_mask: Float[*T]; for sequence levels, the mask whose tokens enter the sum (NeMo-RL multiplies
            token_mask by sample_mask here).
    """
    return level_log_weight(level, prev - gen, token_mask, layout)


@torch.no_grad()
def level_log_weight(level: str, x: torch.Tensor, token_mask: torch.Tensor, layout: TokenLayout) -> torch.Tensor:
    """log w at ``level`` of the per-token log-ratios ``x = prev - gen`` (Float[*T]); see :func:`is_log_weight`."""
    if level == "token":
        return x
    masked = where_mask(x, token_mask)
    if level == "sequence":
        return layout.to_tokens(layout.seq_sum(masked))
    if level == "sequence_mean":
        count = layout.seq_sum(token_mask.to(x.dtype))
        return layout.to_tokens(layout.seq_sum(masked) / count.clamp_min(1))
    if level == "cumulative":
        return layout.prefix_sum(masked)
    raise ValueError(f"unknown IS correction level {level!r}; expected one of {IS_LEVELS}")


@torch.no_grad()
def unmeasured_weights(level: str, unmeasured: torch.Tensor, token_mask: torch.Tensor, layout: TokenLayout):
    """Bool[*T]: the weights of ``level`` whose log-sum contains a term of an ``unmeasured`` token (one whose
    generation log-prob is not finite): the token itself (token), every token of its sequence (sequence,
    sequence_mean), the token and every later token of its sequence (cumulative). ``token_mask``: the level's mask
    (only its tokens enter the sums). Counted through the layout, so packed batches and CP shards agree."""
    if level == "token":
        return unmeasured
    count = where_mask(unmeasured.to(token_mask.dtype), token_mask)
    if level in ("sequence", "sequence_mean"):
        return layout.to_tokens(layout.seq_sum(count)) > 0
    if level == "cumulative":
        return layout.prefix_sum(count) > 0
    raise ValueError(f"unknown IS correction level {level!r}; expected one of {IS_LEVELS}")


# Explicit levels saturate log w here (w <= e^30 ~ 1e13): larger weights only come from mismatches far beyond any
# truncation bound, and summing them would overflow a float32 loss. Legacy (NeMo-RL) levels keep NeMo-RL's rule.
MAX_LOG_WEIGHT = 30.0


@torch.no_grad()
def finite_exp(log_w: torch.Tensor) -> torch.Tensor:
    """exp(log w) with NeMo-RL's handling of non-finite weights: NaN and +-inf become 0."""
    return torch.nan_to_num(torch.exp(log_w), nan=0.0, posinf=0.0, neginf=0.0)


def exp_or_zero(log_w: torch.Tensor) -> torch.Tensor:
    """exp(log w) where it is finite, else 0 — NeMo-RL's nan_to_num value, but with a zero (not NaN) gradient where
    the exponential overflows. Differentiable."""
    ok = torch.isfinite(log_w) & (log_w < torch.finfo(log_w.dtype).max) & (torch.exp(log_w.detach()).isfinite())
    safe = torch.where(ok, log_w, torch.zeros_like(log_w))
    return torch.where(ok, torch.exp(safe), torch.zeros_like(log_w))
