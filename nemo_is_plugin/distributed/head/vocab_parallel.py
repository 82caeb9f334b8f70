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

Score centering's head (``head_ids [..., k]``, :mod:`~nemo_is_plugin.kernels.head_ids`): each rank gathers the ids
it owns from the same chunk before pass 1; their logits ride in the target's all-reduce SUM
(``reduce_partials_and_head``) and share its lse; the backward runs pass 2 with ``g_y + sum_k g_k`` and scatter-adds
``g_k`` at the ids.

The TP merge of the partials (``reduce_partials``) is the only step here that communicates; the chunk math (the
softmax partials and their merge, the two elementwise passes, the vocab shard's columns, the chunk sizes) lives in
:mod:`nemo_is_plugin.kernels`, shared with ``fused_linear.py``, which computes the same quantities from hidden states
and the LM-head shard.
"""

from __future__ import annotations

import torch

from nemo_is_plugin.distributed.parallel.collectives import all_reduce_max, all_reduce_sum
from nemo_is_plugin.distributed.parallel.groups import ProcessGroup, group_rank, group_size
from nemo_is_plugin.kernels.chunk_math import ChunkMath, resolve_backend
from nemo_is_plugin.kernels.chunking import chunk_slices, default_chunk_size
from nemo_is_plugin.kernels.gemm import acc_dtype
from nemo_is_plugin.kernels.head_ids import (
    add_head_columns_,
    check_head_ids,
    dense_grad,
    head_logits,
    head_logprobs,
    localize_head,
    valid_head_grad,
)
from nemo_is_plugin.kernels.softmax_partials import (
    SoftmaxPartials,
    empty_partials,
    finalize_partials,
    partials_rows,
    rescale_partials,
)
from nemo_is_plugin.kernels.vocab_shard import local_vocab_range, localize_target, owned_column


def reduce_partials(p: SoftmaxPartials, tp_group: ProcessGroup | None) -> SoftmaxPartials:
    """Merge the partials of all TP ranks (vocab shards): all-reduce MAX, then one stacked all-reduce SUM.

    No gradient flows through this (the custom backward recomputes from lse); it runs under no_grad.
    """
    return reduce_partials_and_head(p, None, tp_group)[0]


def reduce_partials_and_head(
    p: SoftmaxPartials, head: torch.Tensor | None, tp_group: ProcessGroup | None
) -> tuple[SoftmaxPartials, torch.Tensor | None]:
    """:func:`reduce_partials`, and the ``[n, k]`` head logits (each id's logit on the rank owning it, 0 elsewhere:
    :mod:`~nemo_is_plugin.kernels.head_ids`) summed in the same all-reduce as the target logit."""
    if tp_group is None:
        return p, head
    global_max = all_reduce_max(p.max, tp_group)
    p = rescale_partials(p, global_max)
    fields = [p.sumexp, p.target] + ([] if p.sum_zexp is None else [p.sum_zexp])
    stacked = torch.stack(fields)
    if head is not None:
        stacked = torch.cat([stacked, head.t()])  # [F + k, n]: still one collective
    summed = all_reduce_sum(stacked, tp_group)
    out = SoftmaxPartials(global_max, summed[0], summed[1], summed[2] if p.sum_zexp is not None else None)
    return out, None if head is None else summed[len(fields) :].t()


class _VocabParallelLogprob(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, head_ids, tp_group, chunk_size, with_entropy, backend):
        vocab_local = logits.shape[-1]
        flat = _rows(logits)
        n = flat.shape[0]
        start, end = local_vocab_range(vocab_local, group_rank(tp_group))
        local_t, owned = localize_target(target.reshape(-1), start, end)
        column = owned_column(local_t, owned)
        math = _chunk_math(backend, flat, chunk_size, with_entropy)
        out = empty_partials(n, with_entropy, flat.new_empty(0, dtype=math.acc))
        head = None
        if head_ids is not None:
            head_local, head_owned, head_valid = localize_head(
                head_ids.reshape(n, head_ids.shape[-1]), start, end, vocab_local * group_size(tp_group)
            )
            head = flat.new_empty(head_local.shape, dtype=math.acc)
        for sl in chunk_slices(n, chunk_size):
            if head is not None:  # read before pass 1, from the same chunk
                head[sl] = head_logits(flat[sl], head_local[sl], head_owned[sl], 1.0, math.acc)
            math.partials(flat[sl], local_t[sl], owned[sl], column[sl], 1.0, partials_rows(out, sl), writable=False)
        merged, head = reduce_partials_and_head(out, head, tp_group)
        logprob, lse, entropy = finalize_partials(merged)

        ctx.chunk_size, ctx.backend = chunk_size, backend
        saved_head = (head_local, head_owned, head_valid) if head is not None else (None, None, None)
        ctx.save_for_backward(logits, local_t, owned, lse, entropy if with_entropy else None, *saved_head)
        # entropy is None exactly when with_entropy is False (the partials then have no entropy field)
        out_entropy = logprob.new_empty(0) if entropy is None else entropy.reshape(target.shape)
        out_head = logprob.new_empty(0) if head is None else head_logprobs(head, lse, head_valid)
        for unused, absent in ((out_entropy, entropy is None), (out_head, head is None)):
            if absent:
                ctx.mark_non_differentiable(unused)
        if head is not None:
            out_head = out_head.reshape(head_ids.shape)
        return logprob.reshape(target.shape), out_entropy, out_head

    @staticmethod
    def backward(ctx, grad_logprob, grad_entropy, grad_head):
        logits, local_t, owned, lse, entropy, head_local, head_owned, head_valid = ctx.saved_tensors
        flat = _rows(logits)
        column = owned_column(local_t, owned)
        use_h = grad_entropy is not None and entropy is not None
        use_head = grad_head is not None and head_valid is not None
        math = _chunk_math(ctx.backend, flat, ctx.chunk_size, use_h)
        g_lp = None if grad_logprob is None else grad_logprob.reshape(-1).to(lse.dtype)
        g_h = grad_entropy.reshape(-1).to(lse.dtype) if use_h else None
        g_head = valid_head_grad(grad_head.reshape(head_valid.shape), head_valid, lse.dtype) if use_head else None
        grad = torch.empty(flat.shape, dtype=flat.dtype, device=flat.device)
        for sl in chunk_slices(flat.shape[0], ctx.chunk_size):
            g_dense = None if g_lp is None else g_lp[sl]
            if g_head is not None:
                g_dense = dense_grad(g_dense, g_head[sl])
            math.logits_grad(
                flat[sl],
                grad[sl],
                local_t[sl],
                owned[sl],
                column[sl],
                lse[sl],
                g_dense,
                entropy[sl] if use_h else None,
                None if g_h is None else g_h[sl],
                1.0,
                1.0,
            )
            if g_head is not None:
                add_head_columns_(grad[sl], local_t[sl], owned[sl], head_local[sl], head_owned[sl], g_head[sl], 1.0)
        return grad.reshape(logits.shape), None, None, None, None, None, None


def _rows(logits: torch.Tensor) -> torch.Tensor:
    """``[N, V/TP]`` rows with unit column stride (what both backends index); a copy only for exotic strides."""
    flat = logits.reshape(-1, logits.shape[-1])
    return flat if flat.shape[1] <= 1 or flat.stride(1) == 1 else flat.contiguous()


def _chunk_math(backend: str, flat: torch.Tensor, chunk_size: int, with_entropy: bool) -> ChunkMath:
    resolved = resolve_backend(backend, flat.device, flat.dtype)
    rows = min(chunk_size, flat.shape[0])
    return ChunkMath(
        resolved,
        flat.dtype,
        acc_dtype(flat.dtype),
        flat.device,
        rows,
        flat.shape[1],
        with_entropy=with_entropy,
        fallback=backend == "auto",
    )


def vocab_parallel_logprobs(
    logits: torch.Tensor,
    target: torch.Tensor,
    tp_group: ProcessGroup | None = None,
    *,
    chunk_size: int | None = None,
    with_entropy: bool = False,
    backend: str = "auto",
    head_ids: torch.Tensor | None = None,
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
        head_ids: integer ``[..., k]`` global ids whose log-probs are also wanted (score centering's sampler head),
            from the same lse as the target's (:mod:`~nemo_is_plugin.kernels.head_ids`: each rank gathers the ids it
            owns, summed in the target's all-reduce); an id outside ``[0, V)`` gives ``-inf`` and no gradient.

    Returns:
        fp32 (fp64 for fp64 logits) ``[...]`` log-probs, or ``(logprobs, entropy)`` when ``with_entropy``; with
        ``head_ids`` the ``[..., k]`` head log-probs are appended to that tuple (``(logprobs, head)`` or
        ``(logprobs, entropy, head)``). Differentiable w.r.t. ``logits``; the gradient has ``logits``' dtype.
    """
    if logits.shape[:-1] != target.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and target {tuple(target.shape)} disagree on [...] dims")
    if head_ids is not None:
        check_head_ids(head_ids, tuple(target.shape))
    if chunk_size is None:
        chunk_size = default_chunk_size(logits.shape[-1])  # Triton needs no workspace, but a torch fallback does
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    logprob, entropy, head = _VocabParallelLogprob.apply(
        logits, target, head_ids, tp_group, chunk_size, with_entropy, backend
    )
    outs = (logprob,) + ((entropy,) if with_entropy else ()) + (() if head_ids is None else (head,))
    return outs if len(outs) > 1 else logprob
