"""The log-probs of ``k`` extra token ids per token (score centering's sampler head) from the label's softmax pass.

Score centering (arXiv 2609.20807; verl-project/verl ``verl/trainer/ppo/score_centering.py``) needs the trainer's
``log p_v`` at the sampler's top-k ids ``H`` of every position, normalised by the SAME log-sum-exp as the label's
``log p_y``: its tail model divides ``1 - sum_H q`` by ``1 - sum_H p``, a few percent of the mass, so a normaliser
that differs by bf16 rounding ruins the ratio (SkyRL's fused-head smoke run, erictang000/SkyRL
``score_centering_support.py``, read a tail-mass ratio of 85). Here they come from the same chunk and the same lse:

    forward   h_v = z_v / T gathered from the chunk before pass 1 consumes it ([n, k], 0 where this TP shard does not
              own v), summed over TP in the same all-reduce as the target logit; log p_v = h_v - lse
    backward  dz = s [ (g_y + sum_k g_k) (-p) + g_y onehot(y) + sum_k g_k onehot(v_k) ]

i.e. the ordinary pass 2 with the dense gradient ``g_y + sum_k g_k`` (which puts ``s (g_y + sum_k g_k)`` on the
target column) followed by two scatter-adds: ``-s sum_k g_k`` at the target column and ``s g_k`` at each head
column. Both backends' pass 2 is used unchanged; the corrections are ``[n]`` and ``[n, k]`` scatters (on Triton's
bf16 chunk they round once more than the target column does in registers).

Padding: an id outside ``[0, V)`` (e.g. -1) has no probability: its log-prob is ``-inf`` and it takes no gradient
(its upstream gradient is dropped, NaN included). A valid id repeated in a row gets the gradient of each slot.
Shapes: ``ids``, ``local``, ``owned``, ``valid`` ``[n, k]``; per-token vectors ``[n]``. No communication.
"""

from __future__ import annotations

import torch

from nemo_is_plugin.kernels.vocab_shard import localize_target


def check_head_ids(head_ids: torch.Tensor, rows: tuple[int, ...]) -> None:
    """Raise ValueError unless ``head_ids`` is an integer ``[*rows, k]`` tensor."""
    if head_ids.is_floating_point() or head_ids.is_complex() or head_ids.dtype == torch.bool:
        raise ValueError(f"head_ids must hold integer token ids, got {head_ids.dtype}")
    if head_ids.dim() != len(rows) + 1 or tuple(head_ids.shape[:-1]) != tuple(rows):
        raise ValueError(f"head_ids {tuple(head_ids.shape)} must be [{', '.join(map(str, rows))}, k]")


def localize_head(ids: torch.Tensor, start: int, end: int, vocab: int):
    """Head ids ``[n, k]`` -> (local column clamped into range, owned by this shard, valid: inside ``[0, vocab)``)."""
    ids = ids.long()
    local, owned = localize_target(ids, start, end)
    return local, owned, (ids >= 0) & (ids < vocab)


def head_logits(z: torch.Tensor, local: torch.Tensor, owned: torch.Tensor, in_scale: float, acc: torch.dtype):
    """``z[i, local[i, j]] * in_scale`` in ``acc`` where this shard owns the id, else 0 (``[n, k]``); read before
    pass 1 overwrites ``z``."""
    h = z.gather(1, local).to(acc)
    h = h if in_scale == 1.0 else h * in_scale
    return torch.where(owned, h, 0.0)


def head_logprobs(summed: torch.Tensor, lse: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``log p_v = h_v - lse`` (``[n, k]``) from the TP-summed head logits; ``-inf`` at invalid ids."""
    return torch.where(valid, summed - lse.unsqueeze(-1), float("-inf"))


def valid_head_grad(grad_head: torch.Tensor, valid: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The upstream ``dL/dlog p_v`` in ``dtype``, 0 at invalid ids (whatever inf/NaN it holds there)."""
    return torch.where(valid, grad_head.to(dtype), 0.0)


def dense_grad(grad_label: torch.Tensor | None, grad_head: torch.Tensor) -> torch.Tensor:
    """``g_y + sum_k g_k`` (``[n]``): the factor of ``-p`` in the chunk's gradient (``grad_head`` already valid)."""
    total = grad_head.sum(dim=-1)
    return total if grad_label is None else grad_label + total


def add_head_columns_(
    dz: torch.Tensor,
    local_target: torch.Tensor,
    owned_target: torch.Tensor,
    local: torch.Tensor,
    owned: torch.Tensor,
    grad_head: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Turn pass 2's ``s G (onehot(y) - p)`` (``G = g_y + sum_k g_k``) into ``s (g_y onehot(y) + sum_k g_k
    onehot(v_k) - G p)`` in place: two scatter-adds, no host sync (rows and slots this shard does not own add 0)."""
    gs = grad_head if scale == 1.0 else grad_head * scale
    back = torch.where(owned_target, -gs.sum(dim=-1), 0.0).to(dz.dtype)
    dz.scatter_add_(1, local_target.unsqueeze(-1), back.unsqueeze(-1))
    return dz.scatter_add_(1, local, torch.where(owned, gs, 0.0).to(dz.dtype))


__all__ = [
    "add_head_columns_",
    "check_head_ids",
    "dense_grad",
    "head_logits",
    "head_logprobs",
    "localize_head",
    "valid_head_grad",
]
