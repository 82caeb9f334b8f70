"""Sampled-token log-probs (and entropy) from vocab-sharded logits, exact under TP, chunked, recomputing backward.

Shapes: logits ``[..., V/TP]`` (this rank's vocab shard, bf16/fp16/fp32/fp64), target ``[...]`` global token ids
(flattened to ``N`` tokens internally). Outputs are fp32 ``[...]`` (fp64 for fp64 logits: exactness tests use that).

Math (z = one token's logits over the whole vocab, spread over TP ranks; rank r owns ids ``[r*V/TP, (r+1)*V/TP)``):

    M = max_v z_v                    all-reduce MAX of the local maxima
    S = sum_v exp(z_v - M)           local sums rescaled by exp(m_r - M), all-reduce SUM
    Q = sum_v exp(z_v - M)(z_v - M)  (entropy only) rescaled as exp(m_r - M) (Q_r + (m_r - M) S_r), same SUM
    log p(y) = z_y - M - log S       z_y taken on the owning rank (0 elsewhere), same SUM
    H = log S - Q / S                entropy, computed without cancelling against M

Memory. The forward loops over chunks of ``chunk_size`` tokens: each chunk is reduced to four ``[chunk]`` partials
by pass 1 of :mod:`nemo_is_plugin.kernels.chunk_math` (torch backend: the chunk is copied into one reused fp32
workspace; Triton backend on CUDA: the logits are read in their own dtype, no workspace); the TP reduction then runs
once on the ``[N]`` partials (2 collectives per call, not per chunk). Only ``lse [N]`` (and ``H [N]``) are saved; the
logits themselves are kept by reference (no copy). The backward recomputes each chunk's softmax from the saved lse
(pass 2), needs no communication, and writes the gradient straight into the output buffer: extra memory is at most
one ``[chunk, V/TP]`` fp32 workspace however many chunks there are. NeMo-RL's DistributedLogprob saves the full fp32
softmax [N, V/TP] instead. No host synchronisation happens in the chunk loops.

Gradient (g = dL/dlog p(y), h = dL/dH, p = softmax, both per token):

    dL/dz_v = g (1[v = y] - p_v) - h p_v (log p_v + H)

The static functions below (``local_vocab_range``, ``localize_target``, ``chunk_partials``, ``reduce_partials``,
``logits_grad``; ``SoftmaxPartials``, ``merge_partials``, ``rescale_partials``, ``finalize_partials`` re-exported from
:mod:`nemo_is_plugin.kernels.softmax_partials`) are the communication-free steps and the TP merge; ``fused_linear.py``
reuses them to compute the same quantities from hidden states and the LM-head shard. Keep their names and signatures
stable. ``chunk_partials`` / ``logits_grad`` are allocating wrappers of the one torch implementation in
:mod:`nemo_is_plugin.kernels.chunk_inplace`.
"""

from __future__ import annotations

from typing import Optional

import torch

from nemo_is_plugin.distributed.collectives import all_reduce_max, all_reduce_sum
from nemo_is_plugin.distributed.groups import ProcessGroup, group_rank
from nemo_is_plugin.kernels.chunk_inplace import chunk_partials_, logits_grad_
from nemo_is_plugin.kernels.chunk_math import ChunkMath, resolve_backend
from nemo_is_plugin.kernels.softmax_partials import (
    SoftmaxPartials,
    empty_partials,
    finalize_partials,
    merge_partials,
    rescale_partials,
)
from nemo_is_plugin.kernels.triton_logprob import owned_column

# Budget of one chunk's fp32 logits; 256 MiB keeps 256-1024 tokens per chunk at V/TP = 64k-250k (GEMM-efficient),
# and bounds the chunk temporaries whatever the vocabulary (a fixed 1024 tokens would be 0.6 GB each at V = 152k).
DEFAULT_CHUNK_BYTES = 256 * 2**20


def default_chunk_size(vocab_local: int, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> int:
    """Tokens per chunk such that the chunk's fp32 logits ``[chunk, vocab_local]`` fit in ``chunk_bytes`` (>= 1)."""
    return max(1, chunk_bytes // (4 * max(vocab_local, 1)))


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for half-precision and fp32 logits, fp64 for fp64 logits."""
    return torch.promote_types(dtype, torch.float32)


def local_vocab_range(vocab_local: int, tp_rank: int) -> tuple[int, int]:
    """Global ids ``[start, end)`` owned by ``tp_rank`` when each rank holds ``vocab_local`` consecutive ids."""
    return tp_rank * vocab_local, (tp_rank + 1) * vocab_local


def localize_target(target: torch.Tensor, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Target ids ``[n]`` -> (local column ``[n]`` clamped into range, owned ``Bool[n]``)."""
    owned = (target >= start) & (target < end)
    local = torch.where(owned, target - start, 0)
    return local, owned


def chunk_partials(
    z: torch.Tensor, local_target: torch.Tensor, owned: torch.Tensor, with_entropy: bool
) -> SoftmaxPartials:
    """Softmax partials of one chunk (``z [n, v]`` any float dtype, not modified; computed in fp32 / fp64).

    The allocating form of :func:`~nemo_is_plugin.kernels.chunk_inplace.chunk_partials_` (the one implementation)."""
    work = z.to(compute_dtype(z.dtype), copy=True)
    return chunk_partials_(work, local_target, owned, with_entropy, torch.empty_like(work) if with_entropy else None)


def reduce_partials(p: SoftmaxPartials, tp_group: Optional[ProcessGroup]) -> SoftmaxPartials:
    """Merge the partials of all TP ranks (vocab shards): all-reduce MAX, then one stacked all-reduce SUM.

    No gradient flows through this (the custom backward recomputes from lse); it runs under no_grad.
    """
    if tp_group is None:
        return p
    global_max = all_reduce_max(p.max, tp_group)
    p = rescale_partials(p, global_max)
    fields = [p.sumexp, p.target] + ([] if p.sum_zexp is None else [p.sum_zexp])
    summed = all_reduce_sum(torch.stack(fields), tp_group)
    return SoftmaxPartials(global_max, summed[0], summed[1], summed[2] if p.sum_zexp is not None else None)


def logits_grad(
    z: torch.Tensor,
    local_target: torch.Tensor,
    owned: torch.Tensor,
    lse: torch.Tensor,
    grad_logprob: Optional[torch.Tensor],
    entropy: Optional[torch.Tensor] = None,
    grad_entropy: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """dL/dz for one chunk, fp32 ``[n, v]``: ``g (onehot - p) - h p (log p + H)``; each ``[n]`` input per token.

    ``z`` is not modified. The allocating form of :func:`~nemo_is_plugin.kernels.chunk_inplace.logits_grad_`."""
    work = z.to(compute_dtype(z.dtype), copy=True)
    use_h = grad_entropy is not None and entropy is not None
    scratch = torch.empty_like(work) if use_h else None
    return logits_grad_(work, local_target, owned, lse, grad_logprob, entropy, grad_entropy, scratch)


class _VocabParallelLogprob(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, tp_group, chunk_size, with_entropy, backend):
        vocab_local = logits.shape[-1]
        flat = _rows(logits)
        n = flat.shape[0]
        start, end = local_vocab_range(vocab_local, group_rank(tp_group))
        local_t, owned = localize_target(target.reshape(-1), start, end)
        column = owned_column(local_t, owned)
        math = _chunk_math(backend, flat, chunk_size, with_entropy)
        out = empty_partials(n, with_entropy, flat.new_empty(0, dtype=math.acc))
        for sl in _slices(n, chunk_size):
            rows_out = SoftmaxPartials(*(None if f is None else f[sl] for f in out))
            math.partials(flat[sl], local_t[sl], owned[sl], column[sl], 1.0, rows_out, writable=False)
        logprob, lse, entropy = finalize_partials(reduce_partials(out, tp_group))

        ctx.chunk_size, ctx.backend = chunk_size, backend
        ctx.save_for_backward(logits, local_t, owned, lse, entropy if with_entropy else None)
        out_entropy = entropy.reshape(target.shape) if with_entropy else logprob.new_empty(0)
        if not with_entropy:
            ctx.mark_non_differentiable(out_entropy)
        return logprob.reshape(target.shape), out_entropy

    @staticmethod
    def backward(ctx, grad_logprob, grad_entropy):
        logits, local_t, owned, lse, entropy = ctx.saved_tensors
        flat = _rows(logits)
        column = owned_column(local_t, owned)
        use_h = grad_entropy is not None and entropy is not None
        math = _chunk_math(ctx.backend, flat, ctx.chunk_size, use_h)
        g_lp = None if grad_logprob is None else grad_logprob.reshape(-1).to(lse.dtype)
        g_h = grad_entropy.reshape(-1).to(lse.dtype) if use_h else None
        grad = torch.empty(flat.shape, dtype=flat.dtype, device=flat.device)
        for sl in _slices(flat.shape[0], ctx.chunk_size):
            math.logits_grad(
                flat[sl], grad[sl], local_t[sl], owned[sl], column[sl], lse[sl],
                None if g_lp is None else g_lp[sl], entropy[sl] if use_h else None, g_h[sl] if use_h else None,
                1.0, 1.0,
            )
        return grad.reshape(logits.shape), None, None, None, None, None


def _rows(logits: torch.Tensor) -> torch.Tensor:
    """``[N, V/TP]`` rows with unit column stride (what both backends index); a copy only for exotic strides."""
    flat = logits.reshape(-1, logits.shape[-1])
    return flat if flat.shape[1] <= 1 or flat.stride(1) == 1 else flat.contiguous()


def _chunk_math(backend: str, flat: torch.Tensor, chunk_size: int, with_entropy: bool) -> ChunkMath:
    resolved = resolve_backend(backend, flat.device, flat.dtype)
    rows = min(chunk_size, flat.shape[0])
    return ChunkMath(resolved, flat.dtype, compute_dtype(flat.dtype), flat.device, rows, flat.shape[1],
                     with_entropy=with_entropy, fallback=backend == "auto")


def _slices(n: int, chunk_size: int):
    for start in range(0, n, chunk_size):
        yield slice(start, min(start + chunk_size, n))


def vocab_parallel_logprobs(
    logits: torch.Tensor,
    target: torch.Tensor,
    tp_group: Optional[ProcessGroup] = None,
    *,
    chunk_size: Optional[int] = None,
    with_entropy: bool = False,
    backend: str = "auto",
):
    """Log-prob of ``target`` under softmax(logits) with the vocab sharded over ``tp_group``.

    Args:
        logits: ``[..., V/TP]`` this rank's vocab shard (any float dtype; upcast to fp32 one chunk at a time).
        target: long ``[...]`` global token ids (an id outside ``[0, V)`` gives ``-lse``).
        tp_group: the vocab-parallel group; None = the whole vocab is local.
        chunk_size: tokens per fp32 chunk; bounds the extra memory to O(chunk_size x V/TP). None: the chunk whose
            fp32 logits take DEFAULT_CHUNK_BYTES (see default_chunk_size).
        with_entropy: also return the full-vocab entropy per token.
        backend: the chunk math's backend (see :mod:`nemo_is_plugin.kernels.chunk_math`): "auto" = Triton on CUDA
            (the logits are read in their own dtype, never upcast, no workspace), torch elsewhere; "torch";
            "triton".

    Returns:
        fp32 (fp64 for fp64 logits) ``[...]`` log-probs, or ``(logprobs, entropy)`` when ``with_entropy``.
        Differentiable w.r.t. ``logits``; the gradient has ``logits``' dtype.
    """
    if logits.shape[:-1] != target.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and target {tuple(target.shape)} disagree on [...] dims")
    if chunk_size is None:
        chunk_size = default_chunk_size(logits.shape[-1])  # Triton needs no workspace, but a torch fallback does
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    logprob, entropy = _VocabParallelLogprob.apply(logits, target, tp_group, chunk_size, with_entropy, backend)
    return (logprob, entropy) if with_entropy else logprob
