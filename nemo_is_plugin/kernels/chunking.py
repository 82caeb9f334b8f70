"""How many tokens one chunk of logits holds, and the slices a chunk loop walks.

The chunked log-prob paths never hold more than one ``[chunk, V/TP]`` block of logits (plus the torch backend's
workspaces, :meth:`~nemo_is_plugin.kernels.chunk_math.ChunkMath.workspace_count`). Its size trades memory against
GEMM efficiency: on a CPU a fixed byte budget of fp32 logits; on a GPU a larger budget in the GEMM's dtype, rounded to
GEMM tiles. No communication.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from nemo_is_plugin.kernels.chunk_math import ChunkMath, resolve_backend
from nemo_is_plugin.kernels.gemm import acc_dtype

# Budget of one chunk's fp32 logits; 256 MiB keeps 256-1024 tokens per chunk at V/TP = 64k-250k (GEMM-efficient),
# and bounds the chunk temporaries whatever the vocabulary (a fixed 1024 tokens would be 0.6 GB each at V = 152k).
DEFAULT_CHUNK_BYTES = 256 * 2**20
# Budget of one chunk's buffers on a GPU (the chunk in the compute dtype, plus the torch backend's fp32 workspaces):
# ~1.7k tokens at V/TP = 152k in bf16, ~2.9k at 129k. Beyond dW and dX the fused paths then need under 1 GiB, [N]
# vectors included; larger chunks amortise dW's per-chunk read-modify-write in GEMM 3 (V x H per chunk).
GPU_CHUNK_BYTES = 768 * 2**20
GPU_CHUNK_ALIGN = 128  # GPU chunks are a multiple of this (a GEMM tile), when at least two tiles fit


def default_chunk_size(vocab_local: int, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> int:
    """Tokens per chunk such that the chunk's fp32 logits ``[chunk, vocab_local]`` fit in ``chunk_bytes`` (>= 1)."""
    return max(1, chunk_bytes // (4 * max(vocab_local, 1)))


def device_chunk_size(
    vocab_local: int, device: torch.device, z_dtype: torch.dtype, backend: str, with_entropy: bool = False
) -> int:
    """Tokens per chunk: CPU ``default_chunk_size`` (256 MiB of fp32 logits); GPU ``GPU_CHUNK_BYTES`` over the
    bytes one token's chunk row takes (the chunk in ``z_dtype`` plus the torch backend's workspaces)."""
    if device.type == "cpu":
        return default_chunk_size(vocab_local)
    acc = acc_dtype(z_dtype)
    per_column = z_dtype.itemsize + acc.itemsize * ChunkMath.workspace_count(backend, z_dtype, acc, with_entropy)
    rows = GPU_CHUNK_BYTES // (per_column * max(vocab_local, 1))
    if rows >= 2 * GPU_CHUNK_ALIGN:
        rows -= rows % GPU_CHUNK_ALIGN
    return max(1, rows)


def plan_chunks(
    backend: str,
    device: torch.device,
    dtype: torch.dtype,
    vocab_local: int,
    chunk_size: int | None,
    with_entropy: bool = False,
) -> tuple[str, int]:
    """(backend that will run, tokens per chunk) of one LM-head call over ``[chunk, vocab_local]`` chunks of
    ``dtype``: the backend is resolved first, its kernels compiled (``resolve_backend`` with ``cols``), so that a
    fallback from Triton to torch sizes the default chunk for the torch backend's workspace; ``chunk_size`` (not
    None) is the caller's and is kept whatever the backend."""
    resolved = resolve_backend(backend, device, dtype, cols=vocab_local, with_entropy=with_entropy)
    if chunk_size is not None:
        return resolved, chunk_size
    return resolved, device_chunk_size(vocab_local, device, dtype, resolved, with_entropy)


def chunk_slices(n: int, chunk_size: int) -> Iterator[slice]:
    """Consecutive ``[start, start + chunk_size)`` slices covering ``range(n)``."""
    for start in range(0, n, chunk_size):
        yield slice(start, min(start + chunk_size, n))


__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "GPU_CHUNK_ALIGN",
    "GPU_CHUNK_BYTES",
    "chunk_slices",
    "default_chunk_size",
    "device_chunk_size",
    "plan_chunks",
]
