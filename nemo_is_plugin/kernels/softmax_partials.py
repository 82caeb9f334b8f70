"""Per-token softmax statistics of (part of) a vocabulary, and the online-softmax algebra that merges them.

Shapes: every field is ``[n]`` (one value per token), fp32 (fp64 for fp64 logits). A *part* is any subset of the
vocab columns: a vocab block inside a kernel, a chunk's shard on one TP rank. With ``z`` one token's logits over the
part and ``m = max z``:

    S = sum exp(z - m)              Q = sum exp(z - m)(z - m)   (entropy only)     t = z[target] or 0

Two parts merge exactly: the shift identity ``exp(z - m') = exp(m - m') exp(z - m)`` rescales S,
and ``Q' = exp(m - m') (Q + (m - m') S)``. After all parts are merged (the TP all-reduce does the same over ranks):

    lse = m + log S     log p(target) = t - lse     H = log S - Q / S

This module is pure [n] arithmetic (no [n, V] work, no communication): the chunk kernels (``chunk_inplace``,
``triton_logprob``) produce the partials, ``distributed.head.vocab_parallel.reduce_partials`` merges them over TP.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class SoftmaxPartials(NamedTuple):
    """Per-token partial statistics of a softmax over (part of) the vocab; every field is fp32 ``[n]``.

    ``max``: max logit m over the covered vocab; ``sumexp``: sum exp(z - m); ``target``: the target logit if the
    target id is covered, else 0; ``sum_zexp``: sum exp(z - m)(z - m), or None when entropy is not wanted.
    """

    max: torch.Tensor
    sumexp: torch.Tensor
    target: torch.Tensor
    sum_zexp: torch.Tensor | None


def empty_partials(n: int, with_entropy: bool, like: torch.Tensor) -> SoftmaxPartials:
    """Uninitialised ``[n]`` partials in ``like``'s dtype and device (the output buffers of a chunk loop)."""
    fields = like.new_empty((4 if with_entropy else 3, n))
    return SoftmaxPartials(fields[0], fields[1], fields[2], fields[3] if with_entropy else None)


def partials_rows(p: SoftmaxPartials, sl: slice) -> SoftmaxPartials:
    """Rows ``sl`` of every field: views, so writing them writes ``p``."""
    return SoftmaxPartials(p.max[sl], p.sumexp[sl], p.target[sl], None if p.sum_zexp is None else p.sum_zexp[sl])


def copy_partials_(dst: SoftmaxPartials, src: SoftmaxPartials) -> SoftmaxPartials:
    """Write ``src`` into ``dst`` field by field; ``src`` has every field ``dst`` has (the entropy one included)."""
    dst.max.copy_(src.max)
    dst.sumexp.copy_(src.sumexp)
    dst.target.copy_(src.target)
    if dst.sum_zexp is not None:
        if src.sum_zexp is None:
            raise ValueError("the output partials hold an entropy field, the computed ones do not")
        dst.sum_zexp.copy_(src.sum_zexp)
    return dst


def rescale_partials(p: SoftmaxPartials, new_max: torch.Tensor) -> SoftmaxPartials:
    """Express ``p`` relative to ``new_max >= p.max`` (the shift identity for S and Q; the target is absolute)."""
    delta = p.max - new_max
    scale = delta.exp()
    sum_zexp = None if p.sum_zexp is None else scale * (p.sum_zexp + delta * p.sumexp)
    return SoftmaxPartials(new_max, scale * p.sumexp, p.target, sum_zexp)


def finalize_partials(p: SoftmaxPartials) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Global partials -> (log p(target) ``[n]``, lse ``[n]``, entropy ``[n]`` or None)."""
    log_s = p.sumexp.log()
    lse = p.max + log_s
    entropy = None if p.sum_zexp is None else log_s - p.sum_zexp / p.sumexp
    return p.target - lse, lse, entropy


__all__ = [
    "SoftmaxPartials",
    "copy_partials_",
    "empty_partials",
    "finalize_partials",
    "partials_rows",
    "rescale_partials",
]
