"""Masked reductions with NeMo-RL's semantics: ``sum(v * m) / (N + 1e-8)``, ``N`` the global count when given.

The ``1e-8`` keeps an all-masked batch at 0 instead of NaN, exactly as NeMo-RL's ``masked_mean`` does.
"""

from __future__ import annotations

import torch

EPS = 1e-8


def masked_sum(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sum of ``values`` where ``mask`` is non-zero; masked entries never leak, even if they are inf or NaN.

    Args:
        values: Float[*shape]
        mask: Float or Bool[*shape] (broadcastable)
    Returns:
        0-d tensor.
    """
    return where_mask(values, mask).sum()


def where_mask(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``values * mask`` for a 0/1 mask, but masked entries are exact zeros whatever they held."""
    return torch.where(mask != 0, values * mask, torch.zeros((), dtype=values.dtype, device=values.device))


def masked_mean(values: torch.Tensor, mask: torch.Tensor, normalizer: torch.Tensor | float | None = None):
    """``sum(values * mask) / (normalizer + 1e-8)``; ``normalizer`` defaults to ``mask.sum()`` (local count)."""
    if normalizer is None:
        normalizer = mask.sum()
    return masked_sum(values, mask) / (normalizer + EPS)
