"""Sampled-token log-probs (and entropy) from vocab-sharded logits, exact under TP, chunked, recomputing backward.

Shapes: logits ``[..., V/TP]`` (this rank's vocab shard, bf16/fp16/fp32/fp64), target ``[...]`` global token ids
(flattened to ``N`` tokens internally). Outputs are fp32 ``[...]`` (fp64 for fp64 logits: exactness tests use that).

Math (z = one token's logits over the whole vocab, spread over TP ranks; rank r owns ids ``[r*V/TP, (r+1)*V/TP)``):

    M = max_v z_v                    all-reduce MAX of the local maxima
    S = sum_v exp(z_v - M)           local sums rescaled by exp(m_r - M), all-reduce SUM
    Q = sum_v exp(z_v - M)(z_v - M)  (entropy only) rescaled as exp(m_r - M) (Q_r + (m_r - M) S_r), same SUM
    log p(y) = z_y - M - log S       z_y taken on the owning rank (0 elsewhere), same SUM
    H = log S - Q / S                entropy, computed without cancelling against M

Memory. The forward loops over chunks of ``chunk_size`` tokens: each chunk is upcast to fp32 and reduced to four
``[chunk]`` partials; the TP reduction then runs once on the ``[N]`` partials (2 collectives per call, not per chunk).
Only ``lse [N]`` (and ``H [N]``) are saved; the logits themselves are kept by reference (no copy). The backward
recomputes each chunk's softmax from the saved lse, needs no communication, and writes the gradient straight into
the output buffer: extra fp32 memory is O(chunk_size x V/TP) however many chunks there are. NeMo-RL's
DistributedLogprob saves the full fp32 softmax [N, V/TP] instead.

Gradient (g = dL/dlog p(y), h = dL/dH, p = softmax, both per token):

    dL/dz_v = g (1[v = y] - p_v) - h p_v (log p_v + H)

The static functions below (``local_vocab_range``, ``chunk_partials``, ``merge_partials``, ``reduce_partials``,
``finalize_partials``, ``logits_grad``) are the communication-free steps; ``fused_linear.py`` reuses them to compute the
same quantities from hidden states and the LM-head shard. Keep their names and signatures stable.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from nemo_is_plugin.distributed.collectives import all_reduce_max, all_reduce_sum
from nemo_is_plugin.distributed.groups import ProcessGroup, group_rank

# Budget of one chunk's fp32 logits; 256 MiB keeps 256-1024 tokens per chunk at V/TP = 64k-250k (GEMM-efficient),
# and bounds the chunk temporaries whatever the vocabulary (a fixed 1024 tokens would be 0.6 GB each at V = 152k).
DEFAULT_CHUNK_BYTES = 256 * 2**20


def default_chunk_size(vocab_local: int, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> int:
    """Tokens per chunk such that the chunk's fp32 logits ``[chunk, vocab_local]`` fit in ``chunk_bytes`` (>= 1)."""
    return max(1, chunk_bytes // (4 * max(vocab_local, 1)))


class SoftmaxPartials(NamedTuple):
    """Per-token partial statistics of a softmax over (part of) the vocab; every field is fp32 ``[n]``.

    ``max``: max logit m over the covered vocab; ``sumexp``: sum exp(z - m); ``target``: the target logit if the
    target id is covered, else 0; ``sum_zexp``: sum exp(z - m)(z - m), or None when entropy is not wanted.
    """

    max: torch.Tensor
    sumexp: torch.Tensor
    target: torch.Tensor
    sum_zexp: Optional[torch.Tensor]


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for half-precision and fp32 logits, fp64 for fp64 logits."""
    return torch.promote_types(dtype, torch.float32)


def local_vocab_range(vocab_local: int, tp_rank: int) -> tuple[int, int]:
    """Global ids ``[start, end)`` owned by ``tp_rank`` when each rank holds ``vocab_local`` consecutive ids."""
    return tp_rank * vocab_local, (tp_rank + 1) * vocab_local


def localize_target(target: torch.Tensor, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Target ids ``[n]`` -> (local column ``[n]`` clamped into range, owned ``Bool[n]``)."""
    owned = (target >= start) & (target < end)
    local = torch.where(owned, target - start, torch.zeros_like(target))
    return local, owned


def chunk_partials(
    z: torch.Tensor, local_target: torch.Tensor, owned: torch.Tensor, with_entropy: bool
) -> SoftmaxPartials:
    """Softmax partials of one chunk. ``z`` fp32 ``[n, v]``, ``local_target`` long ``[n]``, ``owned`` bool ``[n]``."""
    m = z.amax(dim=-1)
    target = torch.where(owned, z.gather(-1, local_target.unsqueeze(-1)).squeeze(-1), torch.zeros_like(m))
    shifted = z - m.unsqueeze(-1)
    if with_entropy:
        e = shifted.exp()
        sumexp = e.sum(dim=-1)
        sum_zexp = shifted.mul_(e).sum(dim=-1)  # in place: two [n, v] buffers at most
    else:
        sumexp, sum_zexp = shifted.exp_().sum(dim=-1), None
    return SoftmaxPartials(m, sumexp, target, sum_zexp)


def rescale_partials(p: SoftmaxPartials, new_max: torch.Tensor) -> SoftmaxPartials:
    """Express ``p`` relative to ``new_max >= p.max`` (the shift identity for S and Q; the target is absolute)."""
    delta = p.max - new_max
    scale = delta.exp()
    sum_zexp = None if p.sum_zexp is None else scale * (p.sum_zexp + delta * p.sumexp)
    return SoftmaxPartials(new_max, scale * p.sumexp, p.target, sum_zexp)


def merge_partials(a: SoftmaxPartials, b: SoftmaxPartials) -> SoftmaxPartials:
    """Online-softmax merge of two disjoint vocab blocks of the same tokens (targets add: one of them is 0)."""
    m = torch.maximum(a.max, b.max)
    a, b = rescale_partials(a, m), rescale_partials(b, m)
    sum_zexp = None if a.sum_zexp is None else a.sum_zexp + b.sum_zexp
    return SoftmaxPartials(m, a.sumexp + b.sumexp, a.target + b.target, sum_zexp)


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


def finalize_partials(p: SoftmaxPartials) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """Global partials -> (log p(target) ``[n]``, lse ``[n]``, entropy ``[n]`` or None)."""
    log_s = p.sumexp.log()
    lse = p.max + log_s
    entropy = None if p.sum_zexp is None else log_s - p.sum_zexp / p.sumexp
    return p.target - lse, lse, entropy


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

    ``z`` is not modified; two ``[n, v]`` fp32 buffers are allocated (log p, then p turned into the gradient).
    """
    logp = z - lse.unsqueeze(-1)
    grad = logp.exp()  # p, turned into the gradient in place
    entropy_term = None
    if grad_entropy is not None and entropy is not None:
        entropy_term = logp.add_(entropy.unsqueeze(-1)).mul_(grad)  # p (log p + H), reusing logp's buffer
    if grad_logprob is not None:
        grad.mul_(-grad_logprob.unsqueeze(-1))
        rows = torch.nonzero(owned, as_tuple=True)[0]
        grad.index_put_((rows, local_target[rows]), grad_logprob[rows], accumulate=True)
    else:
        grad.zero_()
    if entropy_term is not None:
        grad.addcmul_(entropy_term, grad_entropy.unsqueeze(-1), value=-1.0)
    return grad


class _VocabParallelLogprob(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, tp_group, chunk_size, with_entropy):
        vocab_local = logits.shape[-1]
        flat = logits.reshape(-1, vocab_local)
        tgt = target.reshape(-1)
        start, end = local_vocab_range(vocab_local, group_rank(tp_group))
        local_t, owned = localize_target(tgt, start, end)

        parts = []
        for s in range(0, flat.shape[0], chunk_size):
            z = flat[s : s + chunk_size].to(compute_dtype(logits.dtype))
            parts.append(chunk_partials(z, local_t[s : s + chunk_size], owned[s : s + chunk_size], with_entropy))
        partials = SoftmaxPartials(*(None if f[0] is None else torch.cat(f) for f in zip(*parts)))
        logprob, lse, entropy = finalize_partials(reduce_partials(partials, tp_group))

        ctx.chunk_size, ctx.shape = chunk_size, target.shape
        ctx.save_for_backward(logits, local_t, owned, lse, entropy if with_entropy else None)
        out_entropy = entropy.reshape(target.shape) if with_entropy else logprob.new_empty(0)
        if not with_entropy:
            ctx.mark_non_differentiable(out_entropy)
        return logprob.reshape(target.shape), out_entropy

    @staticmethod
    def backward(ctx, grad_logprob, grad_entropy):
        logits, local_t, owned, lse, entropy = ctx.saved_tensors
        vocab_local = logits.shape[-1]
        flat = logits.reshape(-1, vocab_local)
        dtype = compute_dtype(logits.dtype)
        g_lp = None if grad_logprob is None else grad_logprob.reshape(-1).to(dtype)
        g_h = None if (grad_entropy is None or entropy is None) else grad_entropy.reshape(-1).to(dtype)
        grad = torch.empty_like(flat)
        c = ctx.chunk_size
        for s in range(0, flat.shape[0], c):
            sl = slice(s, s + c)
            grad[sl] = logits_grad(
                flat[sl].to(dtype),
                local_t[sl],
                owned[sl],
                lse[sl],
                None if g_lp is None else g_lp[sl],
                None if entropy is None else entropy[sl],
                None if g_h is None else g_h[sl],
            )
        return grad.reshape(logits.shape), None, None, None, None


def vocab_parallel_logprobs(
    logits: torch.Tensor,
    target: torch.Tensor,
    tp_group: Optional[ProcessGroup] = None,
    *,
    chunk_size: Optional[int] = None,
    with_entropy: bool = False,
):
    """Log-prob of ``target`` under softmax(logits) with the vocab sharded over ``tp_group``.

    Args:
        logits: ``[..., V/TP]`` this rank's vocab shard (any float dtype; upcast to fp32 one chunk at a time).
        target: long ``[...]`` global token ids (an id outside ``[0, V)`` gives ``-lse``).
        tp_group: the vocab-parallel group; None = the whole vocab is local.
        chunk_size: tokens per fp32 chunk; bounds the extra memory to O(chunk_size x V/TP). None: the chunk whose
            fp32 logits take DEFAULT_CHUNK_BYTES (see default_chunk_size).
        with_entropy: also return the full-vocab entropy per token.

    Returns:
        fp32 (fp64 for fp64 logits) ``[...]`` log-probs, or ``(logprobs, entropy)`` when ``with_entropy``.
        Differentiable w.r.t. ``logits``; the gradient has ``logits``' dtype.
    """
    if logits.shape[:-1] != target.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and target {tuple(target.shape)} disagree on [...] dims")
    if chunk_size is None:
        chunk_size = default_chunk_size(logits.shape[-1])
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    logprob, entropy = _VocabParallelLogprob.apply(logits, target, tp_group, chunk_size, with_entropy)
    return (logprob, entropy) if with_entropy else logprob
