"""The per-chunk softmax math of the log-prob paths in PyTorch, in place: the torch backend (CPU, and CUDA without
triton) of the two passes a chunk of logits goes through (see :mod:`nemo_is_plugin.kernels.chunk_math`).

- pass 1, ``chunk_partials_``: the chunk's softmax partials (max, sum exp, target logit, entropy term) per token;
- pass 2, ``logits_grad_``: ``dz = s (g (onehot - p) - h p (log p + H))`` from the logits and the global lse, or, when
  pass 1 has just left ``exp(z - m)`` in the buffer (the single pass on CPU), ``softmax_grad_from_exp_``, which
  turns it into ``s g (onehot - p)`` with one multiply and a scatter (``logits_grad_`` without the entropy term is
  that same step on ``p = exp(z - lse)``).

``s`` (``scale``) is the logits' scale (1 / temperature: ``dL/d(xW^T) = dL/dz / T``), folded into the per-token
factors so that it costs no pass over the chunk. Everything is computed in the caller's buffer (plus one scratch
buffer when the entropy is involved): a chunk loop reuses one or two ``[chunk, V/TP]`` workspaces instead of
allocating fresh ones per chunk (on CPU a fresh 155 MB tensor is an ``mmap`` whose pages fault in on first touch;
measured on a CPU, pass 1 into fresh buffers cost 0.6-0.7x the chunk's GEMM, into reused ones ~0.1x).

No host synchronisation: the target column is added with a ``scatter_add_`` over every row (rows whose target lies
on another TP rank add 0 at column 0), never through ``nonzero`` / boolean indexing; scalars are Python floats.

Shapes: ``z`` fp32/fp64 ``[n, v]`` (overwritten), per-token vectors ``[n]``, ``scratch`` at least ``[n, v]``.
"""

from __future__ import annotations

import torch

from nemo_is_plugin.kernels.softmax_partials import SoftmaxPartials


def _scratch_rows(scratch: torch.Tensor | None, z: torch.Tensor) -> torch.Tensor:
    """The first ``n`` rows of ``scratch``, checked to match ``z [n, v]`` (``out=`` would silently resize them)."""
    if scratch is None or scratch.shape[1:] != z.shape[1:] or scratch.shape[0] < z.shape[0] or scratch.dtype != z.dtype:
        got = None if scratch is None else (tuple(scratch.shape), scratch.dtype)
        raise ValueError(f"the entropy terms need a scratch buffer [>={z.shape[0]}, {z.shape[1]}] {z.dtype}, got {got}")
    return scratch[: z.shape[0]]


def _add_target_column_(grad: torch.Tensor, local_target: torch.Tensor, owned: torch.Tensor, g: torch.Tensor):
    """``grad[i, local_target[i]] += g[i]`` on the rows whose target this shard owns; every row takes part (the
    others add an exact 0), so no row selection, hence no host sync."""
    grad.scatter_add_(1, local_target.unsqueeze(-1), torch.where(owned, g, 0.0).unsqueeze(-1))
    return grad


def chunk_partials_(
    z: torch.Tensor,
    local_target: torch.Tensor,
    owned: torch.Tensor,
    with_entropy: bool,
    scratch: torch.Tensor | None = None,
) -> SoftmaxPartials:
    """Softmax partials of one chunk (``max``, ``sum exp(z-m)``, target logit, ``sum exp(z-m)(z-m)``); destroys ``z``.

    Without entropy ``z`` holds ``exp(z - m)`` afterwards (what ``softmax_grad_from_exp_`` consumes). ``scratch``
    (``[>=n, v]``, same dtype) is needed only ``with_entropy``: it holds ``exp(z - m)`` while ``z`` holds ``z - m``,
    and their row-wise dot is a batched GEMV (no ``[n, v]`` product is formed).
    """
    n = z.shape[0]
    target = torch.where(owned, z.gather(-1, local_target.unsqueeze(-1)).squeeze(-1), 0.0)
    m = z.amax(dim=-1)
    shifted = z.sub_(m.unsqueeze(-1))
    if not with_entropy:
        return SoftmaxPartials(m, shifted.exp_().sum(dim=-1), target, None)
    e = torch.exp(shifted, out=_scratch_rows(scratch, z))
    sum_zexp = torch.bmm(e.unsqueeze(1), shifted.unsqueeze(2)).view(n)
    return SoftmaxPartials(m, e.sum(dim=-1), target, sum_zexp)


def logits_grad_(
    z: torch.Tensor,
    local_target: torch.Tensor,
    owned: torch.Tensor,
    lse: torch.Tensor,
    grad_logprob: torch.Tensor | None,
    entropy: torch.Tensor | None = None,
    grad_entropy: torch.Tensor | None = None,
    scratch: torch.Tensor | None = None,
    scale: float = 1.0,
) -> torch.Tensor:
    """dL/dz of one chunk times ``scale``, ``s (g (onehot - p) - h p (log p + H))``, written into ``z`` (returned).

    ``g = grad_logprob``, ``h = grad_entropy`` (each ``[n]`` or None). ``scratch`` holds ``p`` when ``h`` is given.
    """
    logp = z.sub_(lse.unsqueeze(-1))
    if grad_entropy is None or entropy is None:
        if grad_logprob is None:
            return logp.zero_()
        return softmax_grad_from_exp_(logp.exp_(), None, local_target, owned, grad_logprob, scale)  # exp(logp) = p
    gs = None if grad_logprob is None else (grad_logprob if scale == 1.0 else grad_logprob * scale)
    p = torch.exp(logp, out=_scratch_rows(scratch, z))
    hs = grad_entropy if scale == 1.0 else grad_entropy * scale
    grad = logp.add_(entropy.unsqueeze(-1)).mul_(hs.unsqueeze(-1))  # s h (log p + H)
    if gs is not None:
        grad.add_(gs.unsqueeze(-1))  # s g + s h (log p + H)
    grad.mul_(p).neg_()
    if gs is not None:
        _add_target_column_(grad, local_target, owned, gs)  # + s g onehot
    return grad


def softmax_grad_from_exp_(
    e: torch.Tensor,
    scale: torch.Tensor | None,
    local_target: torch.Tensor,
    owned: torch.Tensor,
    grad_logprob: torch.Tensor,
    out_scale: float = 1.0,
) -> torch.Tensor:
    """dL/dz ``s g (onehot - p)`` of one chunk from ``e = exp(z - m)``, written into ``e``'s buffer (returned).

    ``scale = exp(m - lse) [n]`` turns ``e`` into ``p`` (None: ``e`` already is ``p``, i.e. ``m = lse``); ``s =
    out_scale``. After pass 1 of the same chunk (``chunk_partials_`` leaves ``exp(z - m)`` in ``z``) this needs no
    recomputed GEMM and one pass over the chunk (plus the scatter of the target column)."""
    gs = grad_logprob if out_scale == 1.0 else grad_logprob * out_scale
    factor = gs.neg() if scale is None else (gs * scale).neg_()
    grad = e.mul_(factor.unsqueeze(-1))  # -s g p
    return _add_target_column_(grad, local_target, owned, gs)  # + s g onehot


__all__ = ["chunk_partials_", "logits_grad_", "softmax_grad_from_exp_"]
