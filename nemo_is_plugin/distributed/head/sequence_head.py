"""Next-token log-probs of a Megatron decoder's output in the layouts hosts hand to their fused heads.

A Megatron GPT decoder ends with hidden states ``[s, b, H]`` (sequence first), which are

- sharded over TP along ``s`` under sequence parallelism (``[s/TP, b, H]`` on each rank);
- under context parallelism, this CP rank's share of every sequence: Megatron's load-balanced order (``2 cp`` chunks
  per sequence, rank r holding chunks r and 2cp-1-r) or the contiguous one (:mod:`~nemo_is_plugin.distributed.
  parallel.cp_sharding`);
- padded (``[S, B, H]``: ``B`` sequences of ``S`` positions) or packed (THD: ``[T, 1, H]``, the sequences back to back
  at ``cu_seqlens_padded``, each padded to a multiple of the CP chunk count).

The token at position ``t`` is scored against the label at ``t + 1`` of the same sequence: the labels are rolled by
one position per sequence (the last position wraps to the sequence's first label; hosts drop it). Under CP the
next label of a chunk's last position lives on another rank, so a CP-sharded label tensor is all-gathered (int64,
``[b, S]`` or ``[T]``: a few bytes per token), rolled, and this rank's share taken again.

:func:`next_token_logprobs` runs the plugin's chunked head (:func:`~nemo_is_plugin.distributed.head.fused_linear.
fused_linear_logprobs`: no ``[tokens, V]`` logits beyond one chunk, TP merge of ``[N]`` partials) on this rank's
tokens and, under CP, all-gathers the log-probs into the full sequence on every CP rank (differentiable: the backward
all-reduces the gradients over CP and keeps this rank's share, so a loss every CP rank computes and divides by the CP
size, as NeMo-RL does, gets the single-process gradient). A target outside ``[0, V)`` (no rank owns it) gives the
value 0 with the gradient of its log-prob ``-lse``: what NeMo-RL's fused head returns for it.
:func:`unpack_next_token_logprobs` turns a packed result into the padded ``[B, S_max - 1]`` a host's loss reads.

Offsets (``cu_seqlens_padded``) are read on the host: Python ints cost nothing, a device tensor one synchronisation
per call (the CP maps need them as ints); nothing synchronises inside the chunk loops.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from nemo_is_plugin.distributed.head.filtered_head import filtered_linear_logprobs, filtering
from nemo_is_plugin.distributed.head.fused_linear import fused_linear_logprobs
from nemo_is_plugin.distributed.parallel.collectives import all_gather
from nemo_is_plugin.distributed.parallel.cp_sharding import (
    CPOrder,
    gather_packed,
    gather_padded,
    shard_packed,
    shard_padded,
)
from nemo_is_plugin.distributed.parallel.groups import ProcessGroup, effective, group_rank, group_size
from nemo_is_plugin.loss.layout import host_ints


@dataclass(frozen=True)
class SequenceLayout:
    """Where a decoder's rows sit: padded ``[S, B]`` or packed THD (``cu_seqlens_padded``, global offsets), and the
    CP group and order (None: no CP)."""

    cu_seqlens_padded: tuple[int, ...] | None = None
    cp_group: ProcessGroup | None = None
    cp_order: CPOrder = "load_balanced"

    @classmethod
    def build(
        cls,
        cu_seqlens_padded: torch.Tensor | Sequence[int] | None = None,
        cp_group: ProcessGroup | None = None,
        cp_order: CPOrder = "load_balanced",
    ) -> SequenceLayout:
        cu = None if cu_seqlens_padded is None else tuple(host_ints(cu_seqlens_padded))
        if cu is not None and (len(cu) < 2 or cu[0] != 0 or any(b < a for a, b in zip(cu[:-1], cu[1:]))):
            raise ValueError(f"cu_seqlens_padded must start at 0 and not decrease, got {list(cu)}")
        return cls(cu, effective(cp_group), cp_order)

    @property
    def packed(self) -> bool:
        return self.cu_seqlens_padded is not None

    @property
    def cp_size(self) -> int:
        return group_size(self.cp_group)

    def shard(self, x: torch.Tensor) -> torch.Tensor:
        """This CP rank's share of a full ``[b, S]`` (padded) or ``[T]`` (packed) tensor."""
        if self.cp_size == 1:
            return x
        rank, cu = group_rank(self.cp_group), self.cu_seqlens_padded
        if cu is not None:
            return shard_packed(x, cu, rank, self.cp_size, self.cp_order)
        return shard_padded(x, rank, self.cp_size, self.cp_order, dim=1)

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """The full tensor from every CP rank's share (differentiable; inverse of :meth:`shard`)."""
        if self.cp_size == 1:
            return x
        if self.cu_seqlens_padded is not None:
            return gather_packed(x, self.cu_seqlens_padded, self.cp_group, self.cp_order)
        return gather_padded(x, self.cp_group, self.cp_order, dim=1)

    def roll(self, labels: torch.Tensor) -> torch.Tensor:
        """Full labels (``[b, S, ...]`` padded, ``[T, ...]`` packed) rolled left by one position within each
        sequence."""
        if not self.packed:
            return labels.roll(-1, dims=1)
        cu = self.cu_seqlens_padded
        assert cu is not None
        nxt = torch.arange(1, labels.shape[0] + 1, device=labels.device)
        lasts = [b - 1 for a, b in zip(cu[:-1], cu[1:]) if b > a]
        firsts = [a for a, b in zip(cu[:-1], cu[1:]) if b > a]
        if lasts:
            nxt[torch.tensor(lasts, device=labels.device)] = torch.tensor(firsts, device=labels.device)
        return labels[nxt]


def local_next_labels(labels: torch.Tensor, layout: SequenceLayout, local_len: int) -> torch.Tensor:
    """This rank's next-token targets: ``labels`` rolled per sequence, in the rows' local order.

    ``labels``: ``[b, S_local]`` / ``[1, T_local]`` (this CP rank's share, as Megatron feeds its model) or the full
    ``[b, S]`` / ``[1, T]``; which one is read off its length against ``local_len`` (the rows this rank holds).
    Trailing dims ride along (score centering's head ids ``[b, S, k]``). Returns ``[b, local_len, ...]``."""
    size = layout.cp_size
    length = labels.shape[1]
    if length not in (local_len, local_len * size):
        raise ValueError(
            f"labels of length {length} fit neither this rank's {local_len} positions nor the full sequence's "
            f"{local_len * size} (CP size {size})"
        )
    if layout.packed:
        if labels.dim() < 2 or labels.shape[0] != 1:
            raise ValueError(f"packed labels must be [1, T], got {tuple(labels.shape)}")
        flat = labels[0]
        if size > 1 and length == local_len:
            flat = layout.gather(flat)
        total = layout.cu_seqlens_padded[-1] if layout.cu_seqlens_padded else 0
        if flat.shape[0] != total:
            raise ValueError(f"packed labels hold {flat.shape[0]} tokens, cu_seqlens_padded ends at {total}")
        return layout.shard(layout.roll(flat)).unsqueeze(0)
    full = layout.gather(labels) if size > 1 and length == local_len else labels
    return layout.shard(layout.roll(full))


def next_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    tp_group: ProcessGroup | None,
    layout: SequenceLayout | None = None,
    *,
    sequence_parallel: bool = False,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk_size: int | None = None,
    backend: str = "auto",
    top_k: int | None = None,
    top_p: float | None = None,
    head_ids: torch.Tensor | None = None,
):
    """Log-probs (and entropy) of each position's next label from sequence-first hidden states, CP-gathered.

    Args:
        hidden: ``[s, b, H]`` this rank's decoder output (``[s/TP, b, H]`` with ``sequence_parallel``; ``b = 1`` and
            ``s`` this CP rank's packed tokens for a packed layout).
        weight: ``[V/TP, H]`` this rank's LM-head rows.
        labels: the input ids, ``[b, S]`` or this CP rank's ``[b, S/cp]`` (packed: ``[1, T]`` / ``[1, T/cp]``).
        tp_group, sequence_parallel, temperature, with_entropy, chunk_size, backend: as
            :func:`~nemo_is_plugin.distributed.head.fused_linear.fused_linear_logprobs`.
        layout: padded or packed, CP group and order (None: padded, no CP).
        top_k, top_p: NeMo-RL's training-time filter (:mod:`~nemo_is_plugin.distributed.head.filtered_head`); when it
            filters, the result is ``(filtered, unfiltered)`` log-probs (no entropy).
        head_ids: score centering's sampler head, integer ``[b, S, k]`` / this CP rank's ``[b, S/cp, k]`` (packed:
            ``[1, T, k]`` / ``[1, T/cp, k]``), aligned with ``labels`` (slot ``s`` holds the ids the sampler ranked
            for token ``s``) and rolled with them; their log-probs come from the labels' pass and lse
            (:mod:`~nemo_is_plugin.kernels.head_ids`) and are appended to the result, ``[b, S, k]`` (``[T, k]``),
            CP-gathered like the log-probs. Not with the top-k / top-p filter.

    Returns:
        ``[b, S]`` (packed: ``[T]``) log-probs of ``labels`` rolled by one within each sequence, the full sequence on
        every CP rank (position ``t`` scores label ``t + 1``; each sequence's last position scores its first label),
        fp32 (fp64 for fp64 inputs); ``(logprobs, entropy)`` with ``with_entropy``.
    """
    layout = SequenceLayout() if layout is None else layout
    if hidden.dim() != 3:
        raise ValueError(f"hidden must be sequence-first [s, b, H], got {tuple(hidden.shape)}")
    tp = effective(tp_group)
    local_len = hidden.shape[0] * (group_size(tp) if sequence_parallel else 1)
    target = local_next_labels(labels, layout, local_len)  # [b, local_len]
    if target.shape != (hidden.shape[1], local_len):
        raise ValueError(f"labels give targets {tuple(target.shape)} for hidden states {tuple(hidden.shape)}")
    vocab = weight.shape[0] * group_size(tp)
    owned = ((target >= 0) & (target < vocab)).t()
    head = None if head_ids is None else local_next_labels(head_ids, layout, local_len)  # [b, local_len, k]
    if head is not None and head.shape[:2] != target.shape:
        raise ValueError(f"head_ids give {tuple(head.shape)} for targets {tuple(target.shape)}")
    if filtering(top_k, top_p):
        if with_entropy:
            raise ValueError("with_entropy is not available with top-k / top-p filtering")
        if head is not None:
            raise ValueError("head_ids (score centering) are not available with top-k / top-p filtering")
        full_rows = all_gather(hidden, tp, dim=0) if sequence_parallel else hidden  # backward: reduce-scatter
        outs = list(
            filtered_linear_logprobs(
                full_rows,
                weight,
                target.t(),
                tp,
                top_k=top_k,
                top_p=top_p,
                temperature=temperature,
                chunk_size=chunk_size,
                reduce_grad_hidden=not sequence_parallel,
            )
        )
    else:
        out = fused_linear_logprobs(
            hidden,
            weight,
            target.t(),
            tp,
            chunk_size=chunk_size,
            temperature=temperature,
            with_entropy=with_entropy,
            sequence_parallel=sequence_parallel,
            backend=backend,
            head_ids=None if head is None else head.transpose(0, 1),
        )
        outs = list(out) if isinstance(out, tuple) else [out]
    outs[0] = torch.where(owned, outs[0], outs[0] - outs[0].detach())  # 0 where no rank owns the target
    results = [r.transpose(0, 1) for r in outs]  # [b, local_len(, k)]
    if layout.packed:
        results = [r[0] for r in results]
    results = [layout.gather(r) for r in results]
    return tuple(results) if len(results) > 1 else results[0]


def unpack_next_token_logprobs(
    packed: torch.Tensor, cu_seqlens_padded: torch.Tensor | Sequence[int], max_seqlen: int
) -> torch.Tensor:
    """``[T]`` packed next-token log-probs -> ``[B, max_seqlen - 1]``: sequence ``i``'s positions ``[0, len_i - 1)``
    (its last position, which scores its own first label, is dropped), zeros after; ``len_i`` the padded length,
    cut at ``max_seqlen - 1``. Differentiable (a gather)."""
    cu = host_ints(cu_seqlens_padded)
    width = max(max_seqlen - 1, 0)
    starts = torch.tensor(cu[:-1], device=packed.device).unsqueeze(1)
    keep = torch.tensor([max(min(b - a - 1, width), 0) for a, b in zip(cu[:-1], cu[1:])], device=packed.device)
    pos = torch.arange(width, device=packed.device).unsqueeze(0)
    valid = pos < keep.unsqueeze(1)
    index = torch.where(valid, starts + pos, 0)
    values = packed[index.reshape(-1)].reshape(index.shape)
    return torch.where(valid, values, torch.zeros_like(values))


__all__ = ["SequenceLayout", "local_next_labels", "next_token_logprobs", "unpack_next_token_logprobs"]
