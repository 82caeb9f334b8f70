"""The float64 reference of the head log-probs (score centering's sampler head): one plain full log-softmax, gathered
at the label and at the ``k`` head ids; ``-inf`` at ids outside ``[0, V)``."""

from __future__ import annotations

import torch


def head_reference(logits: torch.Tensor, target: torch.Tensor, head_ids: torch.Tensor):
    """``(log p(target) [...], log p(head ids) [..., k])`` of ``log_softmax(logits)`` in float64 (differentiable)."""
    logp = torch.log_softmax(logits.double(), dim=-1)
    vocab = logits.shape[-1]
    valid = (head_ids >= 0) & (head_ids < vocab)
    label = logp.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    head = logp.gather(-1, head_ids.clamp(0, vocab - 1))
    return label, torch.where(valid, head, float("-inf"))


def head_ids_with_padding(rows: tuple[int, ...], k: int, vocab: int, seed: int) -> torch.Tensor:
    """Random ``[*rows, k]`` head ids with the padding a sampler sends: -1, an id past the vocab, a repeated id."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (*rows, k), generator=g)
    flat = ids.view(-1, k)
    flat[0, -1] = -1
    if flat.shape[0] > 1:
        flat[1, 0] = vocab + 3
    if flat.shape[0] > 2 and k > 1:
        flat[2, 1] = flat[2, 0]
    return ids


def head_loss(label: torch.Tensor, head: torch.Tensor, c_label: torch.Tensor, c_head: torch.Tensor) -> torch.Tensor:
    """``sum c_y log p_y + sum_valid c_v log p_v`` (the padding slots masked, as the loss masks them)."""
    valid = torch.isfinite(head)
    dtype = torch.promote_types(label.dtype, c_label.dtype)
    return (label.to(dtype) * c_label).sum() + torch.where(valid, head.to(dtype) * c_head, 0.0).sum()


__all__ = ["head_ids_with_padding", "head_loss", "head_reference"]
