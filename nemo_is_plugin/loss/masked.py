"""Masking with NeMo-RL's semantics: masked means are ``sum(v * m) / (N + EPS)``, ``N`` the global count.

The ``1e-8`` keeps an all-masked batch at 0 instead of NaN, exactly as NeMo-RL's ``masked_mean`` does.
"""

from __future__ import annotations

import torch

EPS = 1e-8


def where_mask(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``values * mask`` for a 0/1 mask, but masked entries are exact zeros whatever they held."""
    return torch.where(mask != 0, values * mask, torch.zeros((), dtype=values.dtype, device=values.device))
