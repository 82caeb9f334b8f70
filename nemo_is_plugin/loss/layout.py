"""Which sequence, and which position in it, each local token belongs to; sequence-level reductions over tokens.

The loss math never assumes a `[B, T]` layout: it calls these methods, so the same code serves padded batches,
packed (THD) batches and context-parallel shards (see ``distributed.parallel.context_parallel`` for the CP subclass).

Shapes: a *token tensor* has the layout's ``shape`` (``[B, T]`` padded, ``[N]`` packed, or a CP shard of either);
``S`` = ``num_seqs``.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Protocol

import torch


class BatchGroup(Protocol):
    """The processes holding the other parts of a batch besides the layout's own (CP) group: the data-parallel
    ranks. Implemented in ``distributed.parallel.data_parallel`` (an all-reduce over an explicit group)."""

    def sum(self, t: torch.Tensor) -> torch.Tensor: ...

    def max(self, t: torch.Tensor) -> torch.Tensor: ...


class TokenLayout:
    """Single-process layout: every sequence is complete on this process.

    Args:
        seq_index: Long[*shape] sequence id in ``[0, num_seqs)`` of each token.
        position: Long[*shape] 0-based position of each token in its (global) sequence.
        num_seqs: number of sequences S.
        padded: True when ``seq_index`` is the row index of a ``[S, T]`` tensor and ``position`` the column index;
            enables the fast paths (``sum(-1)``, ``cumsum(-1)``).
        in_order: whether the flattened tokens list each sequence's tokens consecutively in position order (True for
            padded, packed and CP layouts, whose constructors say so). None checks it, at the cost of one host
            synchronisation; the constructors below never need that.
    """

    def __init__(
        self,
        seq_index: torch.Tensor,
        position: torch.Tensor,
        num_seqs: int,
        *,
        padded: bool = False,
        in_order: bool | None = None,
    ):
        if seq_index.shape != position.shape:
            raise ValueError(f"seq_index {tuple(seq_index.shape)} and position {tuple(position.shape)} differ")
        self.seq_index = seq_index
        self.position = position
        self.num_seqs = int(num_seqs)
        # Not ``self.padded``: that name is the class's constructor of padded layouts.
        self.is_padded = padded
        self._flat_seq = seq_index.reshape(-1)
        if padded:
            in_order = True
        elif in_order is None:
            seq, pos = self._flat_seq, position.reshape(-1)
            ordered = (seq[1:] > seq[:-1]) | ((seq[1:] == seq[:-1]) & (pos[1:] >= pos[:-1]))
            in_order = bool(ordered.all())
        # Permutation that orders tokens by (sequence, position); None when they already are (padded, THD, CP).
        self._order = None if in_order else _lexsort(self._flat_seq, position.reshape(-1))
        self._batch_group: BatchGroup | None = None  # the DP ranks of batch statistics (with_batch_group)

    # ------------------------------------------------------------------ constructors
    @classmethod
    def padded(cls, num_seqs: int, seq_len: int, device: torch.device | str | None = None) -> TokenLayout:
        """Layout of a padded ``[num_seqs, seq_len]`` token tensor."""
        rows = torch.arange(num_seqs, device=device).unsqueeze(1).expand(num_seqs, seq_len)
        cols = torch.arange(seq_len, device=device).unsqueeze(0).expand(num_seqs, seq_len)
        return cls(rows, cols, num_seqs, padded=True)

    @classmethod
    def packed(cls, cu_seqlens: torch.Tensor | Sequence[int], device: torch.device | str | None = None) -> TokenLayout:
        """Layout of a packed ``[N]`` token tensor holding sequences ``cu_seqlens[i]:cu_seqlens[i+1]`` (THD).

        ``device`` defaults to the device of ``cu_seqlens`` (a tensor), else the default device. Offsets given as
        Python ints cost no host synchronisation; a device tensor costs one (it is read once, to size the maps).
        """
        if isinstance(cu_seqlens, torch.Tensor):
            device = cu_seqlens.device if device is None else device
        cu = host_ints(cu_seqlens)
        lengths = [b - a for a, b in zip(cu[:-1], cu[1:])]
        n = sum(lengths)
        lengths_t = torch.tensor(lengths, dtype=torch.long, device=device)
        starts = torch.tensor([a - cu[0] for a in cu[:-1]], dtype=torch.long, device=device)
        seq = torch.repeat_interleave(torch.arange(len(lengths), device=device), lengths_t, output_size=n)
        pos = torch.arange(n, device=device) - torch.repeat_interleave(starts, lengths_t, output_size=n)
        return cls(seq, pos, len(lengths), in_order=True)

    @property
    def holds_whole_sequences(self) -> bool:
        """True when every sequence is complete here (False for a CP shard, whose prefix sums need other ranks)."""
        return True

    @property
    def in_memory_order(self) -> bool:
        """True when the flattened token tensor lists each sequence's tokens consecutively in position order."""
        return self._order is None

    @property
    def shape(self) -> torch.Size:
        return self.seq_index.shape

    # ------------------------------------------------------------------ reductions (overridden under CP)
    def seq_sum(self, x: torch.Tensor) -> torch.Tensor:
        """Per-sequence sum. x: token tensor -> [S] (differentiable)."""
        if self.is_padded:
            return x.sum(-1)
        out = x.new_zeros(self.num_seqs)
        return out.index_add(0, self._flat_seq, x.reshape(-1))

    @torch.no_grad()
    def seq_max(self, x: torch.Tensor) -> torch.Tensor:
        """Per-sequence max (no grad); -inf for a sequence without tokens. -> [S]."""
        return self._scatter_reduce(x, "amax", float("-inf"))

    @torch.no_grad()
    def seq_min(self, x: torch.Tensor) -> torch.Tensor:
        """Per-sequence min (no grad); +inf for a sequence without tokens. -> [S]."""
        return self._scatter_reduce(x, "amin", float("inf"))

    def prefix_sum(self, x: torch.Tensor) -> torch.Tensor:
        """Inclusive prefix sum along each sequence, accumulated in float64. x, return: token tensor."""
        return self._local_prefix_sum(x.double()).to(x.dtype)

    def to_tokens(self, s: torch.Tensor) -> torch.Tensor:
        """Broadcast a per-sequence tensor [S] to a token tensor."""
        if self.is_padded:
            return s.unsqueeze(-1).expand(self.shape)
        return s[self.seq_index]

    def gather_sequences(self, x: torch.Tensor) -> tuple[torch.Tensor, TokenLayout]:
        """``x`` with every token of its sequences (flat), and the single-process layout of those tokens: for a
        statistic that needs whole sequences (CPPO's quantile). Here, where sequences are whole: ``x`` itself."""
        return x.reshape(-1), TokenLayout(self._flat_seq, self.position.reshape(-1), self.num_seqs, in_order=True)

    def replicated_share(self, x: torch.Tensor) -> torch.Tensor:
        """This process's share of a value that every CP rank holds in full (x / cp_size under CP; x here)."""
        return x

    # Batch statistics (a statistic of the whole batch the loss's terms read, an objective's second moment): partials of
    # this process's tokens summed / maxed over the layout's CP group and the data-parallel ranks of with_batch_group.
    def with_batch_group(self, group: BatchGroup | None) -> TokenLayout:
        """This layout, whose batch statistics also span ``group`` (the DP ranks; None: this process's batch)."""
        if group is None:
            return self
        out = copy.copy(self)
        out._batch_group = group
        return out

    def reduce_batch_sums(self, t: torch.Tensor) -> torch.Tensor:
        t = self.reduce_metric_sums(t)
        return t if self._batch_group is None else self._batch_group.sum(t)

    def reduce_batch_max(self, t: torch.Tensor) -> torch.Tensor:
        t = self.reduce_metric_max(t)
        return t if self._batch_group is None else self._batch_group.max(t)

    # Metric reductions: no-ops here; the CP layout all-reduces them over its group.
    def reduce_metric_sums(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def reduce_metric_max(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def reduce_metric_min(self, t: torch.Tensor) -> torch.Tensor:
        return t

    # ------------------------------------------------------------------ helpers
    def _scatter_reduce(self, x: torch.Tensor, reduce: str, empty: float) -> torch.Tensor:
        out = torch.full((self.num_seqs,), empty, dtype=x.dtype, device=x.device)
        return out.scatter_reduce(0, self._flat_seq, x.reshape(-1), reduce=reduce, include_self=True)

    def _local_prefix_sum(self, x: torch.Tensor) -> torch.Tensor:
        """Prefix sum over the tokens held here, restarting at each sequence (no communication)."""
        if self.is_padded:
            return torch.cumsum(x, dim=-1)
        flat = x.reshape(-1)
        if self._order is not None:
            flat = flat[self._order]
        total = torch.cumsum(flat, 0)
        seq = self._flat_seq if self._order is None else self._flat_seq[self._order]
        # Subtract the running total reached before each segment starts: a segment-wise cumsum without a loop.
        starts = torch.ones_like(seq, dtype=torch.bool)
        starts[1:] = seq[1:] != seq[:-1]
        before = torch.where(starts, total - flat, torch.zeros_like(total))
        offset_idx = torch.cummax(torch.where(starts, torch.arange(len(seq), device=seq.device), 0), 0).values
        out = total - before[offset_idx]
        if self._order is not None:
            out = torch.empty_like(out).index_copy(0, self._order, out)
        return out.reshape(x.shape)


def host_ints(values: torch.Tensor | Sequence[int]) -> list[int]:
    """Integers as a Python list; a device tensor is read in one host synchronisation."""
    if isinstance(values, torch.Tensor):
        return [int(v) for v in values.reshape(-1).tolist()]
    return [int(v) for v in values]


def _lexsort(seq: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Stable permutation ordering tokens by (seq, pos), without reading the tensors on the host."""
    by_pos = torch.argsort(pos, stable=True)
    return by_pos[torch.argsort(seq[by_pos], stable=True)]
