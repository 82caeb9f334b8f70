"""Which tokens of each sequence a context-parallel rank holds, and the shard / gather maps.

Two orders, both cutting every sequence into equal chunks:

- ``load_balanced`` (Megatron / NeMo-RL default): ``2*cp`` chunks, rank r holds chunks r and 2cp-1-r, in that order,
  so causal-attention work is balanced. A sequence's length must be a multiple of ``2*cp``.
- ``contiguous``: ``cp`` chunks, rank r holds chunk r. Length a multiple of ``cp``.

Padded batches ``[B, S]`` are sharded along the sequence dim to ``[B, S/cp]``. Packed (THD) batches ``[N]`` with
``cu_seqlens_padded`` (each sequence already padded to a multiple of ``2*cp``, as Megatron requires) are sharded
sequence by sequence to ``[N/cp]``, the local sequences keeping their order: local ``cu_seqlens = cu_seqlens_padded /
cp``.

No Python loop over sequences: the maps are built with ``repeat_interleave`` and integer arithmetic.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, NamedTuple

import torch

from nemo_is_plugin.distributed.parallel.collectives import all_gather
from nemo_is_plugin.distributed.parallel.groups import ProcessGroup, group_size
from nemo_is_plugin.loss.layout import host_ints

CPOrder = Literal["load_balanced", "contiguous"]
CP_ORDERS: tuple[str, ...] = ("load_balanced", "contiguous")


class LocalTokens(NamedTuple):
    """The local tokens of a CP rank, each a long ``[n_local]`` tensor in local (storage) order.

    ``seq``: sequence id; ``position``: 0-based position in the global sequence; ``chunk``: global chunk id within
    the sequence (0..num_chunks-1); ``global_index``: index into the global packed ``[N]`` tensor.
    """

    seq: torch.Tensor
    position: torch.Tensor
    chunk: torch.Tensor
    global_index: torch.Tensor


def num_chunks(cp_size: int, order: CPOrder) -> int:
    """Chunks each sequence is cut into."""
    _check_order(order)
    return 2 * cp_size if order == "load_balanced" else cp_size


def local_chunk_ids(cp_rank: int, cp_size: int, order: CPOrder) -> tuple[int, ...]:
    """Global chunk ids held by ``cp_rank``, in local order."""
    _check_order(order)
    return (cp_rank, 2 * cp_size - 1 - cp_rank) if order == "load_balanced" else (cp_rank,)


def local_tokens(
    lengths: torch.Tensor | Sequence[int],
    cp_rank: int,
    cp_size: int,
    order: CPOrder = "load_balanced",
    device: torch.device | str | None = None,
) -> LocalTokens:
    """Local tokens of ``cp_rank`` for sequences of (padded) ``lengths [n]`` laid out back to back.

    ``device`` defaults to the device of ``lengths`` (a tensor), else the default device. Lengths given as Python ints
    cost no host synchronisation; a device tensor costs one (it is read once, to size the maps).
    Raises ValueError if a length is not a multiple of the number of chunks.
    """
    if isinstance(lengths, torch.Tensor):
        device = lengths.device if device is None else device
    host = host_ints(lengths)
    n_chunks = num_chunks(cp_size, order)
    if any(n % n_chunks for n in host):
        raise ValueError(
            f"{order} context parallelism over {cp_size} ranks needs every sequence length to be a multiple of "
            f"{n_chunks}; got lengths {host} (pad each sequence, as Megatron does)"
        )
    local_ids = local_chunk_ids(cp_rank, cp_size, order)
    ids = torch.tensor(local_ids, dtype=torch.long, device=device)
    chunk_len = torch.tensor([n // n_chunks for n in host], dtype=torch.long, device=device)
    local_len = chunk_len * len(ids)
    n_local = sum(host) // n_chunks * len(local_ids)
    seq = torch.repeat_interleave(torch.arange(len(host), device=device), local_len, output_size=n_local)
    local_start = torch.cumsum(local_len, 0) - local_len
    k = torch.arange(n_local, device=device) - local_start[seq]
    c = chunk_len[seq]
    which = torch.div(k, c, rounding_mode="floor")  # 0 or 1: first or second local chunk
    chunk = ids[which]
    position = chunk * c + (k - which * c)
    lengths_t = chunk_len * n_chunks
    global_start = torch.cumsum(lengths_t, 0) - lengths_t
    return LocalTokens(seq, position, chunk, global_start[seq] + position)


def padded_local_positions(
    seq_len: int,
    cp_rank: int,
    cp_size: int,
    order: CPOrder = "load_balanced",
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Global positions ``Long[S/cp]`` held by ``cp_rank`` along the sequence dim of a padded ``[B, S]`` batch."""
    return local_tokens([seq_len], cp_rank, cp_size, order, device).position


def shard_padded(
    x: torch.Tensor, cp_rank: int, cp_size: int, order: CPOrder = "load_balanced", dim: int = 1
) -> torch.Tensor:
    """``x [B, S, ...]`` -> this rank's ``[B, S/cp, ...]`` (along ``dim``)."""
    if cp_size == 1:
        return x
    pos = padded_local_positions(x.shape[dim], cp_rank, cp_size, order, x.device)
    return x.index_select(dim, pos)


def shard_packed(
    x: torch.Tensor,
    cu_seqlens_padded: torch.Tensor | Sequence[int],
    cp_rank: int,
    cp_size: int,
    order: CPOrder = "load_balanced",
    dim: int = 0,
) -> torch.Tensor:
    """Packed ``x [N, ...]`` (sequences at ``cu_seqlens_padded``) -> this rank's ``[N/cp, ...]`` (along ``dim``)."""
    if cp_size == 1:
        return x
    idx = local_tokens(_lengths(cu_seqlens_padded), cp_rank, cp_size, order, x.device).global_index
    return x.index_select(dim, idx)


def local_cu_seqlens(
    cu_seqlens_padded: torch.Tensor | Sequence[int], cp_size: int, device: torch.device | str | None = None
) -> torch.Tensor:
    """``cu_seqlens`` of the local packed shard: every (padded) sequence keeps 1/cp of its tokens.

    ``device`` defaults to the device of ``cu_seqlens_padded`` (a tensor), else the default device."""
    if isinstance(cu_seqlens_padded, torch.Tensor):
        device = cu_seqlens_padded.device if device is None else device
    cu = torch.as_tensor(cu_seqlens_padded, dtype=torch.long, device=device)
    return torch.div(cu, cp_size, rounding_mode="floor")


def _gather(x: torch.Tensor, cp_group: ProcessGroup | None, dim: int, index_of_rank) -> torch.Tensor:
    """All-gather the shards along ``dim`` (differentiable) and put every token back at its global index."""
    size = group_size(cp_group)
    if size == 1:
        return x
    stacked = all_gather(x, cp_group, dim=dim)  # rank-major: [shard_0 | shard_1 | ...]
    where = torch.cat([index_of_rank(r) for r in range(size)])
    inverse = torch.empty_like(where)
    inverse[where] = torch.arange(len(where), device=where.device)
    return stacked.index_select(dim, inverse)


def gather_padded(
    x: torch.Tensor, cp_group: ProcessGroup | None, order: CPOrder = "load_balanced", dim: int = 1
) -> torch.Tensor:
    """Inverse of ``shard_padded``: ``[B, S/cp, ...]`` on every rank -> ``[B, S, ...]`` on every rank."""
    size = group_size(cp_group)
    seq_len = x.shape[dim] * size
    return _gather(x, cp_group, dim, lambda r: padded_local_positions(seq_len, r, size, order, x.device))


def gather_packed(
    x: torch.Tensor,
    cu_seqlens_padded: torch.Tensor | Sequence[int],
    cp_group: ProcessGroup | None,
    order: CPOrder = "load_balanced",
    dim: int = 0,
) -> torch.Tensor:
    """Inverse of ``shard_packed``: ``[N/cp, ...]`` on every rank -> ``[N, ...]`` on every rank."""
    lengths = _lengths(cu_seqlens_padded)
    size = group_size(cp_group)
    return _gather(x, cp_group, dim, lambda r: local_tokens(lengths, r, size, order, x.device).global_index)


def _lengths(cu_seqlens: torch.Tensor | Sequence[int]) -> list[int]:
    cu = host_ints(cu_seqlens)
    return [b - a for a, b in zip(cu[:-1], cu[1:])]


def _check_order(order: str) -> None:
    if order not in CP_ORDERS:
        raise ValueError(f"unknown context-parallel order {order!r}; expected one of {CP_ORDERS}")


__all__ = [
    "CPOrder",
    "CP_ORDERS",
    "LocalTokens",
    "gather_packed",
    "gather_padded",
    "local_chunk_ids",
    "local_cu_seqlens",
    "local_tokens",
    "num_chunks",
    "padded_local_positions",
    "shard_packed",
    "shard_padded",
]
