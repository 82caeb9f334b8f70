"""Sampled-token log-probs (and entropy) straight from hidden states and the vocab-sharded LM-head weight.

Shapes: ``hidden [..., H]`` (replicated over TP, or sequence-sharded with ``sequence_parallel=True``), ``weight
[V/TP, H]`` (this rank's rows of the LM head), ``target [...]`` global token ids. Outputs are fp32 ``[...]`` (fp64 for
fp64 inputs).

This is :mod:`vocab_parallel` with the logits never materialised beyond one chunk of ``chunk_size`` tokens:

    forward,  per chunk:  z = x_c W^T  (GEMM 1, into one reused [chunk, V/TP] buffer in the compute dtype)
                          pass 1: softmax partials of z / T per token        (kernels.chunk_math)
              once:       TP merge of the [N] partials (2 collectives per call), log p, lse [N], entropy [N]
    backward, per chunk:  z = x_c W^T  (GEMM 1 again: nothing of size [N, V/TP] was kept)
                          pass 2: dz = (g (onehot - p) - h p (log p + H)) / T  in z's buffer
                          dX_c = dz W  (GEMM 2, into dX's rows)      dW += dz^T X_c  (GEMM 3, in place)

with ``g = dL/dlog p``, ``h = dL/dH`` the upstream gradients. Saved for backward: the inputs (by reference), ``lse
[N]`` and, with entropy, ``H [N]``. Cost: 4 GEMMs for forward + backward (1 + 1 recompute + 2 gradient GEMMs) and two
reads and one write of each chunk element by the elementwise passes. :mod:`fused_linear_loss` runs the loss in the
same loop when the loss allows it (3 GEMMs).

With ``head_ids [..., k]`` (score centering's sampler head, :mod:`~nemo_is_plugin.kernels.head_ids`) each chunk also
gathers the k ids' logits it owns before pass 1 (k gathers per token), summed over TP in the same all-reduce as the
target logit, normalised by the same lse; the backward's pass 2 runs with ``g_y + sum_k g_k`` and two scatter-adds
move ``g_k`` to the ids' columns. GEMMs unchanged.

Why a custom autograd.Function and not autograd over the chunks: autograd would keep every chunk's logits alive
until the backward. Here the loss sees only ``logprobs [N]``; sequence-level ratios need the whole sequence's log-probs
before any per-token gradient is known, and plain autograd already orders the work that way.

TP semantics (Megatron's): every TP rank sees the same log-probs and hence the same upstream gradient; the hidden
states' gradient is the SUM over ranks of each shard's ``dz @ W_r``, all-reduced here once after the last chunk. With
``sequence_parallel=True`` the hidden states arrive sharded over the sequence, are all-gathered over TP in the forward,
and the backward is a reduce-scatter.

Device policy. CPU: each chunk is computed in fp32 (bf16 inputs are upcast: a bf16 CPU GEMM is ~100x slower), the
chunk is 256 MiB of fp32 logits, the torch backend does the elementwise passes. GPU: the GEMMs run in the input
dtype, the chunk stays in it (bf16 logits, as on the naive bf16 path; statistics and ``dz`` are computed in fp32 in
registers and ``dz`` is rounded to bf16 once, as the naive path's gradient is), chunks are sized by
``GPU_CHUNK_BYTES`` (thousands of tokens), and the passes are Triton kernels (``backend="auto"``). The dW accumulator
and its precision: :mod:`nemo_is_plugin.kernels.gemm`. No host synchronisation happens inside the chunk loops.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from nemo_is_plugin.distributed.head.vocab_parallel import reduce_partials_and_head
from nemo_is_plugin.distributed.parallel.collectives import all_gather, all_reduce_sum
from nemo_is_plugin.distributed.parallel.groups import ProcessGroup, group_rank, group_size
from nemo_is_plugin.kernels.chunk_math import ChunkMath, resolve_backend
from nemo_is_plugin.kernels.chunking import chunk_slices, plan_chunks
from nemo_is_plugin.kernels.gemm import (
    WeightGrad,
    acc_dtype,
    chunk_logits,
    compute_dtype,
    default_grad_weight_dtype,
)
from nemo_is_plugin.kernels.head_ids import (
    add_head_columns_,
    check_head_ids,
    dense_grad,
    head_logits,
    head_logprobs,
    localize_head,
    valid_head_grad,
)
from nemo_is_plugin.kernels.softmax_partials import SoftmaxPartials, empty_partials, finalize_partials, partials_rows
from nemo_is_plugin.kernels.vocab_shard import local_vocab_range, localize_target, owned_column


def check_lm_head_call(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    temperature: float,
    chunk_size: int | None,
    *,
    backend: str = "auto",
    with_entropy: bool = False,
    head_ids: torch.Tensor | None = None,
) -> int:
    """Raise ValueError naming the argument unless the shapes and settings of an LM-head call agree; returns the chunk
    size in tokens (``plan_chunks``: ``device_chunk_size`` of the backend that will run when ``chunk_size`` is None)."""
    if hidden.shape[:-1] != target.shape:
        raise ValueError(f"hidden {tuple(hidden.shape)} and target {tuple(target.shape)} disagree on [...] dims")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight {tuple(weight.shape)} must be [V/TP, H] with H = {hidden.shape[-1]}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if head_ids is not None:
        check_head_ids(head_ids, tuple(target.shape))
    _, chunk = plan_chunks(backend, hidden.device, compute_dtype(hidden), weight.shape[0], chunk_size, with_entropy)
    if chunk < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    return chunk


def check_grad_weight_out(weight: torch.Tensor, grad_weight_out: torch.Tensor | None) -> None:
    """Raise ValueError unless ``grad_weight_out`` (when given) can receive the weight's gradient."""
    if grad_weight_out is None:
        return
    if grad_weight_out.shape != weight.shape or grad_weight_out.device != weight.device:
        raise ValueError(
            f"grad_weight_out must be {tuple(weight.shape)} on {weight.device}, got "
            f"{tuple(grad_weight_out.shape)} on {grad_weight_out.device}"
        )
    if not grad_weight_out.is_floating_point() or grad_weight_out.requires_grad:
        raise ValueError("grad_weight_out must be a floating-point buffer that does not require grad")
    if not weight.requires_grad:
        raise ValueError("grad_weight_out is given but weight.requires_grad is False: nothing would be accumulated")


@dataclass(frozen=True)
class HeadOptions:
    """The non-tensor arguments of one fused LM-head call (see ``fused_linear_logprobs``)."""

    tp_group: ProcessGroup | None
    chunk_size: int
    inv_temperature: float
    backend: str = "auto"
    reduce_grad_hidden: bool = True
    grad_weight_dtype: torch.dtype | None = None
    grad_weight_out: torch.Tensor | None = None
    # a compiler for the chunk's torch work beside the GEMMs (ChunkMath's passes, the head's gather and scatter)
    compile_torch: Callable[[Callable[..., Any]], Callable[..., Any]] | None = None


class HeadChunks:
    """What the chunk loops of one call share: flat inputs, the target's columns, dtypes and the chunk buffers."""

    def __init__(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        target_local: torch.Tensor,
        owned: torch.Tensor,
        opts: HeadOptions,
        *,
        with_entropy: bool = False,
        head: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ):
        self.x = hidden.reshape(-1, hidden.shape[-1])
        self.n, self.vocab = self.x.shape[0], weight.shape[0]
        self.dtype = compute_dtype(self.x)
        self.acc = acc_dtype(self.dtype)
        self.w = weight.to(self.dtype)  # no copy unless the CPU upcast applies
        compiled = opts.compile_torch or (lambda fn: fn)
        self.local_t, self.owned = target_local, owned
        self.target_column = compiled(owned_column)(target_local, owned)
        self.head = head  # (local column, owned, valid) [N, k] of the head ids, or None
        self.opts = opts
        self.backend = resolve_backend(opts.backend, self.x.device, self.dtype)
        rows = min(opts.chunk_size, self.n)
        self.math = ChunkMath(
            self.backend,
            self.dtype,
            self.acc,
            self.x.device,
            rows,
            self.vocab,
            with_entropy=with_entropy,
            fallback=opts.backend == "auto",
            compile_torch=opts.compile_torch,
        )
        # compiled passes: one spare row, so that every chunk is a proper view of the buffer (dynamo guards on whether a
        # view spans its base: a full chunk and the ragged last one would be two graphs, a recompile as lengths change)
        spare = int(opts.compile_torch is not None)
        self.zbuf = torch.empty(rows + spare, self.vocab, dtype=self.dtype, device=self.x.device)
        self._head_logits, self._add_head_columns = compiled(head_logits), compiled(add_head_columns_)

    @classmethod
    def build(cls, hidden, weight, target, head_ids, opts: HeadOptions, *, with_entropy: bool = False) -> HeadChunks:
        """The chunks of a call: this rank's columns of the target ``[...]`` and of the head ids ``[..., k]``."""
        compiled = opts.compile_torch or (lambda fn: fn)
        start, end = local_vocab_range(weight.shape[0], group_rank(opts.tp_group))
        local_t, owned = compiled(localize_target)(target.reshape(-1), start, end)
        head = None
        if head_ids is not None:
            vocab = weight.shape[0] * group_size(opts.tp_group)
            ids = head_ids.reshape(local_t.shape[0], head_ids.shape[-1])
            head = compiled(localize_head)(ids, start, end, vocab)
        return cls(hidden, weight, local_t, owned, opts, with_entropy=with_entropy, head=head)

    def slices(self) -> Iterator[slice]:
        return chunk_slices(self.n, self.opts.chunk_size)

    def head_logits(self, sl: slice, z: torch.Tensor) -> torch.Tensor | None:
        """The chunk's head logits ``[n, k]`` (scaled by 1/T, 0 where another shard owns the id), read from ``z``
        before pass 1; None without head ids."""
        if self.head is None:
            return None
        return self._head_logits(z, self.head[0][sl], self.head[1][sl], self.opts.inv_temperature, self.acc)

    def add_head_grad_(self, sl: slice, dz: torch.Tensor, grad_head: torch.Tensor | None) -> torch.Tensor:
        """Pass 2 ran with ``g_y + sum_k g_k``: move ``s g_k`` from the target column to the head ids' columns."""
        if self.head is None or grad_head is None:
            return dz
        lt, ow = self.local_t[sl], self.owned[sl]
        inv_t = self.opts.inv_temperature
        return self._add_head_columns(dz, lt, ow, self.head[0][sl], self.head[1][sl], grad_head, inv_t)

    def rows(self, sl: slice) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(local target, owned, target column) of the chunk ``sl``."""
        return self.local_t[sl], self.owned[sl], self.target_column[sl]

    def grad_buffers(self, need_x: bool, need_w: bool, weight: torch.Tensor):
        """dX ``[N, H]`` in the compute dtype (or None) and the dW accumulator (or None)."""
        grad_x = torch.empty(self.x.shape, dtype=self.dtype, device=self.x.device) if need_x else None
        dw_dtype = default_grad_weight_dtype(weight, self.opts.grad_weight_dtype)
        grad_w = WeightGrad(weight, dw_dtype, self.opts.grad_weight_out) if need_w else None
        return grad_x, grad_w

    def chunk_grads(self, sl: slice, dz: torch.Tensor, x_c: torch.Tensor, grad_x, grad_w) -> None:
        """GEMMs 2 and 3 of one chunk: ``dX[sl] = dz W``, ``dW += dz^T x_c``."""
        if grad_x is not None:
            torch.mm(dz, self.w, out=grad_x[sl])
        if grad_w is not None:
            grad_w.add(dz, x_c)

    def finish_grad_x(self, grad_x: torch.Tensor | None, hidden: torch.Tensor) -> torch.Tensor | None:
        """All-reduce dX over TP (each rank holds its vocab shard's share) unless sequence parallel reduce-scatters
        it later; cast to the hidden states' dtype and shape."""
        if grad_x is None:
            return None
        if self.opts.reduce_grad_hidden:
            grad_x = all_reduce_sum(grad_x, self.opts.tp_group)
        return grad_x.to(hidden.dtype).reshape(hidden.shape)


def _chunk_partials(chunks: HeadChunks, with_entropy: bool) -> tuple[SoftmaxPartials, torch.Tensor | None]:
    """Pass 1 over every chunk (GEMM 1 + partials), written into ``[N]`` buffers; the head logits ``[N, k]``."""
    out = empty_partials(chunks.n, with_entropy, chunks.x.new_empty(0, dtype=chunks.acc))
    head = None if chunks.head is None else chunks.x.new_empty(chunks.head[0].shape, dtype=chunks.acc)
    inv_t = chunks.opts.inv_temperature
    for sl in chunks.slices():
        z = chunk_logits(chunks.x[sl].to(chunks.dtype), chunks.w, chunks.zbuf)  # GEMM 1
        if head is not None and chunks.head is not None:  # before pass 1 consumes z
            head[sl] = head_logits(z, chunks.head[0][sl], chunks.head[1][sl], inv_t, chunks.acc)
        chunks.math.partials(z, *chunks.rows(sl), inv_t, partials_rows(out, sl))
    return out, head


class _FusedLinearLogprob(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, target, head_ids, opts: HeadOptions, with_entropy: bool):
        chunks = HeadChunks.build(hidden, weight, target, head_ids, opts, with_entropy=with_entropy)
        partials, head = _chunk_partials(chunks, with_entropy)
        merged, head = reduce_partials_and_head(partials, head, opts.tp_group)
        logprob, lse, entropy = finalize_partials(merged)

        ctx.opts = opts
        saved_head = (None, None, None) if chunks.head is None else chunks.head
        ctx.save_for_backward(
            hidden, weight, chunks.local_t, chunks.owned, lse, entropy if with_entropy else None, *saved_head
        )
        # entropy is None exactly when with_entropy is False (the partials then have no entropy field)
        out_entropy = logprob.new_empty(0) if entropy is None else entropy.reshape(target.shape)
        out_head = logprob.new_empty(0)
        if head is not None and chunks.head is not None:
            out_head = head_logprobs(head, lse, chunks.head[2]).reshape(head_ids.shape)
        del chunks
        for unused, absent in ((out_entropy, entropy is None), (out_head, head is None)):
            if absent:
                ctx.mark_non_differentiable(unused)
        return logprob.reshape(target.shape), out_entropy, out_head

    @staticmethod
    def backward(ctx, grad_logprob, grad_entropy, grad_head):
        hidden, weight, local_t, owned, lse, entropy, *saved_head = ctx.saved_tensors
        head = None if saved_head[0] is None else (saved_head[0], saved_head[1], saved_head[2])
        opts: HeadOptions = ctx.opts
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        use_h = grad_entropy is not None and entropy is not None
        chunks = HeadChunks(hidden, weight, local_t, owned, opts, with_entropy=use_h, head=head)
        g_lp = None if grad_logprob is None else grad_logprob.reshape(-1).to(lse.dtype)
        g_h = grad_entropy.reshape(-1).to(lse.dtype) if use_h else None
        g_head = None
        if head is not None and grad_head is not None:
            g_head = valid_head_grad(grad_head.reshape(head[2].shape), head[2], lse.dtype)
        grad_x, grad_w = chunks.grad_buffers(need_x, need_w, weight)
        inv_t = opts.inv_temperature
        for sl in chunks.slices():
            x_c = chunks.x[sl].to(chunks.dtype)
            z = chunk_logits(x_c, chunks.w, chunks.zbuf)  # GEMM 1, recomputed
            g_dense = None if g_lp is None else g_lp[sl]
            if g_head is not None:
                g_dense = dense_grad(g_dense, g_head[sl])
            dz = chunks.math.logits_grad(
                z,
                z,
                *chunks.rows(sl),
                lse[sl],
                g_dense,
                entropy[sl] if use_h else None,
                None if g_h is None else g_h[sl],
                inv_t,
                inv_t,
            )
            dz = chunks.add_head_grad_(sl, dz, None if g_head is None else g_head[sl])
            chunks.chunk_grads(sl, dz, x_c, grad_x, grad_w)  # GEMMs 2 and 3
        grad_x = chunks.finish_grad_x(grad_x, hidden)
        return grad_x, None if grad_w is None else grad_w.result(), None, None, None, None


def fused_linear_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    tp_group: ProcessGroup | None = None,
    *,
    chunk_size: int | None = None,
    temperature: float = 1.0,
    with_entropy: bool = False,
    sequence_parallel: bool = False,
    backend: str = "auto",
    grad_weight_out: torch.Tensor | None = None,
    grad_weight_dtype: torch.dtype | None = None,
    reduce_grad_hidden: bool = True,
    head_ids: torch.Tensor | None = None,
):
    """Log-prob of ``target`` under ``softmax(hidden @ W.T / temperature)`` with W's rows sharded over ``tp_group``.

    Args:
        hidden: ``[..., H]`` final hidden states, identical on every TP rank; with ``sequence_parallel`` this rank's
            ``[n_local, ..., H]`` shard of dim 0 (all-gathered here; ``target`` must then be the gathered ``[n, ...]``).
        weight: ``[V/TP, H]`` this rank's LM-head rows (global ids ``[r V/TP, (r+1) V/TP)``).
        target: long ``[...]`` global token ids (an id outside ``[0, V)`` gives ``-lse``).
        tp_group: the vocab-parallel group; None = the whole vocab is local (no communication).
        chunk_size: tokens per chunk; bounds the extra memory to O(chunk_size x V/TP). None: ``device_chunk_size``
            (CPU: 256 MiB of fp32 logits; GPU: ``GPU_CHUNK_BYTES`` of chunk buffers).
        temperature: logits are divided by it (sampling temperature of the rollout engine).
        with_entropy: also return the full-vocab entropy per token (differentiable).
        sequence_parallel: ``hidden`` is sharded over TP along dim 0 (Megatron sequence parallelism).
        backend: "auto" (Triton kernels for the elementwise passes on CUDA, torch elsewhere; falls back to torch with
            a warning if triton is missing or a kernel fails to compile, an error with NEMO_IS_STRICT_BACKEND=1),
            "torch", or "triton" (no fallback).
        grad_weight_out: a ``[V/TP, H]`` floating-point buffer (typically Megatron's fp32 ``main_grad``) that the
            weight's gradient is ADDED into during the backward; ``weight`` then receives no ``.grad``. Requires
            ``weight.requires_grad``; nothing is added when no backward runs (e.g. under ``torch.no_grad``).
        grad_weight_dtype: dtype of the dW accumulator when ``grad_weight_out`` is None: None = fp32 on CPU, the
            weight's dtype on GPUs (see :mod:`nemo_is_plugin.kernels.gemm` for the numerics); ``torch.float32`` =
            exact fp32 chunk sums, rounded once (costs a ``V/TP x H`` fp32 buffer).
        reduce_grad_hidden: without ``sequence_parallel``, True = the full ``dL/dhidden`` on every rank (all-reduced
            over TP here); False = this rank's vocab shard's share only, for a caller whose own op sums it over TP
            (verl's fused forward: Megatron's ``gather_from_sequence_parallel_region`` reduce-scatters it).
        head_ids: integer ``[..., k]`` global ids whose log-probs are also wanted (score centering's sampler head),
            from the same chunk and lse as the target's (:mod:`~nemo_is_plugin.kernels.head_ids`); an id outside
            ``[0, V)`` gives ``-inf`` and no gradient.

    Returns:
        fp32 ``[...]`` log-probs, or ``(logprobs, entropy)`` when ``with_entropy``; with ``head_ids`` the ``[..., k]``
        head log-probs are appended to that tuple. Differentiable w.r.t. ``hidden``
        (full gradient on every rank; the shard's under ``sequence_parallel``) and ``weight`` (this shard's rows).
    """
    check_grad_weight_out(weight, grad_weight_out)
    if sequence_parallel:
        # all_gather's backward is the reduce-scatter of the per-rank partial dX: no second all-reduce inside.
        hidden = all_gather(hidden, tp_group, dim=0)
    chunk = check_lm_head_call(
        hidden, weight, target, temperature, chunk_size, backend=backend, with_entropy=with_entropy, head_ids=head_ids
    )
    reduce_x = reduce_grad_hidden and not sequence_parallel
    opts = HeadOptions(tp_group, chunk, 1.0 / temperature, backend, reduce_x, grad_weight_dtype, grad_weight_out)
    logprob, entropy, head = _FusedLinearLogprob.apply(hidden, weight, target, head_ids, opts, with_entropy)
    outs = (logprob,) + ((entropy,) if with_entropy else ()) + (() if head_ids is None else (head,))
    return outs if len(outs) > 1 else logprob


__all__ = ["HeadChunks", "HeadOptions", "check_grad_weight_out", "check_lm_head_call", "fused_linear_logprobs"]
