"""Which vocab columns a tensor-parallel rank holds, and where each token's target lies among them.

With the vocab split over TP ranks in consecutive blocks of ``V/TP`` ids, rank ``r`` holds the logits of the global
ids ``[r V/TP, (r+1) V/TP)``. A token's target is *owned* by the rank whose block contains it; every other rank adds
nothing for it (its target logit counts as 0 in the softmax partials, see :mod:`~nemo_is_plugin.kernels.
softmax_partials`). Shapes: ``target``, ``local_target``, ``owned`` are ``[n]``. No communication.
"""

from __future__ import annotations

import torch


def local_vocab_range(vocab_local: int, tp_rank: int) -> tuple[int, int]:
    """Global ids ``[start, end)`` owned by ``tp_rank`` when each rank holds ``vocab_local`` consecutive ids."""
    return tp_rank * vocab_local, (tp_rank + 1) * vocab_local


def localize_target(target: torch.Tensor, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Target ids ``[n]`` -> (local column ``[n]`` clamped into range, owned ``Bool[n]``)."""
    owned = (target >= start) & (target < end)
    local = torch.where(owned, target - start, 0)
    return local, owned


def owned_column(local_target: torch.Tensor, owned: torch.Tensor) -> torch.Tensor:
    """The Triton kernels' target column: the local id where this shard owns the target, else -1 (long ``[n]``)."""
    return torch.where(owned, local_target, -1).contiguous()


__all__ = ["local_vocab_range", "localize_target", "owned_column"]
