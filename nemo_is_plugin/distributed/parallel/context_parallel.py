"""The TokenLayout of a context-parallel shard: sequence reductions and prefix sums that span all CP ranks.

Each CP rank holds some chunks of every sequence (``cp_sharding``). The layout's reductions are exact without
gathering the sequence:

- ``seq_sum``: local per-sequence partial sums, all-reduced SUM over ``cp_group`` (backward: all-reduce SUM of the
  gradients, because every rank uses the replicated sum in its own loss term).
- ``seq_max`` / ``seq_min``: local partials all-reduced MAX / MIN (no gradient).
- ``prefix_sum``: an exclusive scan across chunks in global sequence order. Each rank computes its per-(sequence,
  chunk) totals into a dense ``[S, num_chunks]`` table that is zero on the chunks it does not hold; one all-reduce SUM
  fills in the table on every rank (the same bytes an all-gather of the held chunks would move, with the chunks
  landing in their global slots). The exclusive cumsum of the table along the chunks is added to the prefix sum inside
  each local chunk. Everything runs in float64; the gradient flows through the all-reduce, so a token's value reaches
  the prefix sums of later chunks on other ranks.
- ``replicated_share``: under CP every rank holds the same full-sequence loss term; each returns 1/cp of it, so the
  loss summed over the CP group is the single-process loss.
- ``reduce_metric_*``: metric partials over local tokens, reduced over the CP group so that every rank reports the
  full-sequence metric.
- ``gather_sequences``: the one statistic that needs every token of a sequence at once (CPPO's per-sequence quantile):
  an all-gather of the shards (no gradient).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from nemo_is_plugin.distributed.parallel.collectives import all_gather, all_reduce_max, all_reduce_min, all_reduce_sum
from nemo_is_plugin.distributed.parallel.cp_sharding import CPOrder, local_cu_seqlens, local_tokens, num_chunks
from nemo_is_plugin.distributed.parallel.groups import ProcessGroup, group_rank, group_size
from nemo_is_plugin.loss.layout import TokenLayout, host_ints


class CPTokenLayout(TokenLayout):
    """Layout of one CP rank's tokens.

    Args:
        seq_index, position: Long[*shape] sequence id and GLOBAL position of each local token.
        chunk_index: Long[*shape] global chunk id (0..num_chunks-1) of each token within its sequence; the tokens of
            one (sequence, chunk) must be consecutive positions (true for both CP orders).
        num_seqs: number of sequences. num_chunks: chunks per sequence (2*cp load-balanced, cp contiguous).
        cp_group: the context-parallel group (None behaves like a single process holding all chunks).
    """

    def __init__(
        self,
        seq_index: torch.Tensor,
        position: torch.Tensor,
        chunk_index: torch.Tensor,
        num_seqs: int,
        num_chunks: int,
        cp_group: ProcessGroup | None,
        *,
        in_order: bool | None = None,
    ):
        super().__init__(seq_index, position, num_seqs, in_order=in_order)
        self.cp_group = cp_group
        self.cp_size = group_size(cp_group)
        self.num_chunks = int(num_chunks)
        # One "sequence" per (sequence, chunk): its local prefix sum is the prefix sum inside the chunk, its seq_sum
        # the chunk totals in a dense [S * num_chunks] table.
        self._chunk_id = seq_index * self.num_chunks + chunk_index
        # Chunks are consecutive positions, so the (chunk, position) order is the (sequence, position) order.
        self._chunks = TokenLayout(
            self._chunk_id, position, self.num_seqs * self.num_chunks, in_order=self.in_memory_order
        )

    @property
    def holds_whole_sequences(self) -> bool:
        return False

    def seq_sum(self, x: torch.Tensor) -> torch.Tensor:
        return all_reduce_sum(super().seq_sum(x), self.cp_group)

    @torch.no_grad()
    def seq_max(self, x: torch.Tensor) -> torch.Tensor:
        return all_reduce_max(super().seq_max(x), self.cp_group)

    @torch.no_grad()
    def seq_min(self, x: torch.Tensor) -> torch.Tensor:
        return all_reduce_min(super().seq_min(x), self.cp_group)

    def prefix_sum(self, x: torch.Tensor) -> torch.Tensor:
        x64 = x.double()
        within = self._chunks._local_prefix_sum(x64)
        totals = all_reduce_sum(self._chunks.seq_sum(x64), self.cp_group).view(self.num_seqs, self.num_chunks)
        before = (torch.cumsum(totals, dim=1) - totals).reshape(-1)  # exclusive scan over chunks, per sequence
        return (within + before[self._chunk_id]).to(x.dtype)

    def replicated_share(self, t: torch.Tensor) -> torch.Tensor:
        return t / self.cp_size

    @torch.no_grad()
    def gather_sequences(self, x: torch.Tensor) -> tuple[torch.Tensor, TokenLayout]:
        """Every rank's tokens (all ranks hold equally many: CP pads each sequence to a multiple of the chunk count),
        with their sequence ids and global positions: whole sequences, in rank order (not position order)."""
        gathered = [all_gather(t.reshape(-1), self.cp_group) for t in (x, self._flat_seq, self.position)]
        return gathered[0], TokenLayout(gathered[1], gathered[2], self.num_seqs, in_order=False)

    def reduce_metric_sums(self, t: torch.Tensor) -> torch.Tensor:
        return all_reduce_sum(t, self.cp_group)

    def reduce_metric_max(self, t: torch.Tensor) -> torch.Tensor:
        return all_reduce_max(t, self.cp_group)

    def reduce_metric_min(self, t: torch.Tensor) -> torch.Tensor:
        return all_reduce_min(t, self.cp_group)


def cp_layout_padded(
    num_seqs: int,
    seq_len: int,
    cp_group: ProcessGroup | None,
    order: CPOrder = "load_balanced",
    device: torch.device | str | None = None,
) -> TokenLayout:
    """Layout of this rank's ``[B, S/cp]`` shard of a padded ``[B, S]`` batch (``seq_len`` = global S).

    With no CP (group None or of size one) this is ``TokenLayout.padded(B, S)``.
    """
    size = group_size(cp_group)
    if size == 1:
        return TokenLayout.padded(num_seqs, seq_len, device=device)
    lt = local_tokens([seq_len], group_rank(cp_group), size, order, device)
    rows = torch.arange(num_seqs, device=device).unsqueeze(1).expand(num_seqs, len(lt.position))
    return CPTokenLayout(
        rows,
        lt.position.expand_as(rows),
        lt.chunk.expand_as(rows),
        num_seqs,
        num_chunks(size, order),
        cp_group,
        in_order=True,
    )


def cp_layout_packed(
    cu_seqlens_padded: torch.Tensor | Sequence[int],
    cp_group: ProcessGroup | None,
    order: CPOrder = "load_balanced",
    device: torch.device | str | None = None,
) -> TokenLayout:
    """Layout of this rank's ``[N/cp]`` shard of a packed batch (global ``cu_seqlens_padded``, THD).

    With no CP this is ``TokenLayout.packed(cu_seqlens_padded)``. ``device`` defaults to the device of
    ``cu_seqlens_padded`` (a tensor), else the default device. Offsets given as Python ints cost no host
    synchronisation; a device tensor costs one.
    """
    if isinstance(cu_seqlens_padded, torch.Tensor):
        device = cu_seqlens_padded.device if device is None else device
    cu = host_ints(cu_seqlens_padded)
    size = group_size(cp_group)
    if size == 1:
        return TokenLayout.packed(cu, device=device)
    lengths = [b - a for a, b in zip(cu[:-1], cu[1:])]
    lt = local_tokens(lengths, group_rank(cp_group), size, order, device)
    return CPTokenLayout(lt.seq, lt.position, lt.chunk, len(lengths), num_chunks(size, order), cp_group, in_order=True)


def cp_layout(
    cp_group: ProcessGroup | None,
    order: CPOrder = "load_balanced",
    *,
    num_seqs: int | None = None,
    seq_len: int | None = None,
    cu_seqlens_padded: torch.Tensor | Sequence[int] | None = None,
    device: torch.device | str | None = None,
) -> TokenLayout:
    """Padded (``num_seqs``, ``seq_len``) or packed (``cu_seqlens_padded``) layout of this CP rank's tokens."""
    if cu_seqlens_padded is not None:
        return cp_layout_packed(cu_seqlens_padded, cp_group, order, device)
    if num_seqs is None or seq_len is None:
        raise ValueError("cp_layout needs num_seqs and seq_len (padded) or cu_seqlens_padded (packed)")
    return cp_layout_padded(num_seqs, seq_len, cp_group, order, device)


__all__ = ["CPTokenLayout", "cp_layout", "cp_layout_packed", "cp_layout_padded", "local_cu_seqlens"]
