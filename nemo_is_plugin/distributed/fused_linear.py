"""Sampled-token log-probs (and entropy) straight from hidden states and the vocab-sharded LM-head weight.

Shapes: ``hidden [..., H]`` (replicated over TP, or sequence-sharded with ``sequence_parallel=True``), ``weight
[V/TP, H]`` (this rank's rows of the LM head), ``target [...]`` global token ids. Outputs are fp32 ``[...]`` (fp64 for
fp64 inputs).

This is :mod:`vocab_parallel` with the logits never materialised: for every chunk of ``chunk_size`` tokens the
chunk's logits ``z = hidden_c @ weight.T / temperature`` (fp32 ``[chunk, V/TP]``) are computed into one reused
workspace and reduced to the four ``[chunk]`` softmax partials. The TP merge is vocab_parallel's
(``localize_target``, ``reduce_partials``, ``finalize_partials``: once on the ``[N]`` partials, 2 collectives per call);
the per-chunk math is the in-place twin of its ``chunk_partials`` / ``logits_grad`` (:mod:`kernels.chunk_inplace`,
same values, no fresh ``[chunk, V/TP]`` allocations). Saved for backward: the inputs (by reference), ``lse [N]`` and,
with entropy, ``H [N]``: 4-8 bytes per token. Extra memory: 1 chunk workspace (2 with entropy) + the gradients.

Why a custom autograd.Function and not autograd over the chunks: autograd would keep every chunk's logits (or
softmax) alive until the backward, i.e. the full ``[N, V/TP]``. Here the loss sees only ``logprobs [N]``; sequence-level
and cumulative ratios / IS weights need the whole sequence's log-probs before any per-token gradient is known, and
plain autograd already orders the work that way: (1) this forward produces every log-prob, (2) the loss runs on them,
(3) ``loss.backward()`` hands this backward ``dL/dlogprob [N]``, which recomputes each chunk's logits and accumulates

    dz    = (g (onehot - p) - h p (log p + H)) / temperature      fp32 [chunk, V/TP]   (logits_grad_)
    dX_c  = dz @ W                                                 [chunk, H]
    dW   += dz.T @ X_c                                             fp32 [V/TP, H]

so at most one chunk of ``[tokens x vocab]`` is alive at any time. Cost: 1 GEMM forward, 3 backward (1 recompute +
2 gradient GEMMs), i.e. 4x the forward GEMM for forward+backward.

TP semantics (Megatron's): every TP rank sees the same log-probs and hence the same upstream gradient; the hidden
states' gradient is the SUM over ranks of each shard's ``dz @ W_r``, all-reduced here once after the last chunk (the
job Megatron's ``copy_to_tensor_model_parallel_region`` does). With ``sequence_parallel=True`` the hidden states
arrive sharded over the sequence, are all-gathered over TP in the forward, and the backward is a reduce-scatter.

Precision: on CPU each chunk is computed in fp32 (a bf16 GEMM there is ~100x slower than fp32); a bf16 weight is
upcast once per forward and once per backward (an extra ``V/TP x H`` fp32 buffer, independent of the token count).
On other devices the GEMMs run in the input dtype with fp32 outputs (``mm_fp32``); softmax statistics, ``dz`` and the
``dW`` accumulator are fp32 everywhere. ``backend="triton"`` (CUDA, opt-in, see :mod:`kernels.triton_logprob`) runs the
forward as one kernel that never writes logits, and the backward's elementwise pass as one kernel per chunk.
"""

from __future__ import annotations

from typing import Iterator, Optional

import torch

from nemo_is_plugin.distributed.collectives import all_gather, all_reduce_sum
from nemo_is_plugin.distributed.groups import ProcessGroup, group_rank
from nemo_is_plugin.distributed.vocab_parallel import (
    DEFAULT_CHUNK_BYTES,
    SoftmaxPartials,
    default_chunk_size,
    finalize_partials,
    local_vocab_range,
    localize_target,
    reduce_partials,
)
from nemo_is_plugin.kernels.chunk_inplace import chunk_partials_, logits_grad_
from nemo_is_plugin.kernels.triton_logprob import fused_partials, logits_grad_triton_, triton_usable

BACKENDS = ("torch", "triton")

def compute_dtype(tensor: torch.Tensor) -> torch.dtype:
    """dtype the GEMMs run in: fp32 on CPU (bf16/fp16 CPU GEMMs are ~100x slower), the input dtype elsewhere."""
    if tensor.device.type == "cpu" and tensor.dtype in (torch.bfloat16, torch.float16):
        return torch.float32
    return tensor.dtype


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """dtype of the softmax statistics and of the weight-gradient accumulator: fp32, or fp64 for fp64 inputs."""
    return torch.promote_types(dtype, torch.float32)


def chunk_slices(n: int, chunk_size: int) -> Iterator[slice]:
    """Consecutive ``[start, start + chunk_size)`` slices covering ``range(n)``."""
    for start in range(0, n, chunk_size):
        yield slice(start, min(start + chunk_size, n))


def chunk_logits(x: torch.Tensor, weight: torch.Tensor, inv_temperature: float, out: torch.Tensor) -> torch.Tensor:
    """Logits of one chunk, ``x [n, H] @ weight[V/TP, H].T * inv_temperature``, written into ``out[:n]`` (returned).

    ``x`` and ``weight`` are in the compute dtype; ``out`` is the fp32 (fp64 for fp64 inputs) chunk workspace. When
    the GEMM runs in a lower precision (bf16 on GPU) its result is upcast into ``out``.
    """
    z = out[: x.shape[0]]
    if weight.dtype == z.dtype:
        torch.mm(x, weight.t(), out=z)
    else:  # GPU bf16: fp32 GEMM output, so the recomputed z matches the forward's fp32 lse
        z.copy_(mm_fp32(x, weight.t()))
    if inv_temperature != 1.0:
        z.mul_(inv_temperature)
    return z


def mm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` of low-precision operands with an fp32 result: cuBLAS's ``out_dtype`` where torch has it (CUDA,
    torch >= 2.8), else the low-precision result upcast (one extra rounding of each output)."""
    try:
        return torch.mm(a, b, out_dtype=torch.float32)
    except (RuntimeError, TypeError, NotImplementedError):
        return torch.mm(a, b).float()


def add_chunk_grads(
    dz: torch.Tensor,
    w: torch.Tensor,
    x_c: torch.Tensor,
    grad_x_rows: Optional[torch.Tensor],
    grad_w: Optional[torch.Tensor],
    need_w: bool,
) -> Optional[torch.Tensor]:
    """The gradient GEMMs of one chunk: ``dX_c = dz @ W`` written into ``grad_x_rows`` (None: not wanted) and
    ``dW += dz.T @ X_c``, returned (``grad_w`` None: this chunk's GEMM creates it).

    ``dz [n, V/TP]`` and ``x_c [n, H]`` are in the compute dtype. dW is accumulated in fp32 (fp64 for fp64 inputs): a
    bf16 running sum would lose the small per-chunk contributions. The first chunk's GEMM writes the accumulator,
    because zero-filling then adding a V x H buffer cost 0.9x a GEMM at DeepSeek-V3's shape.
    """
    if grad_x_rows is not None:
        torch.mm(dz, w, out=grad_x_rows)
    if not need_w:
        return grad_w
    if dz.dtype == acc_dtype(dz.dtype):
        return torch.mm(dz.t(), x_c) if grad_w is None else grad_w.addmm_(dz.t(), x_c)
    # low-precision GEMM with an fp32 output, chunk sums accumulated in fp32
    return mm_fp32(dz.t(), x_c) if grad_w is None else grad_w.add_(mm_fp32(dz.t(), x_c))


def _workspace(rows: int, cols: int, dtype: torch.dtype, device: torch.device, count: int) -> list[torch.Tensor]:
    """``count`` reusable ``[rows, cols]`` chunk buffers, allocated once per forward / backward call."""
    return [torch.empty(rows, cols, dtype=dtype, device=device) for _ in range(count)]


class _FusedLinearLogprob(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, target, tp_group, chunk_size, inv_temperature, with_entropy, reduce_grad_hidden,
                backend):
        x = hidden.reshape(-1, hidden.shape[-1])
        start, end = local_vocab_range(weight.shape[0], group_rank(tp_group))
        local_t, owned = localize_target(target.reshape(-1), start, end)
        dtype = compute_dtype(x)
        w = weight.to(dtype)  # no copy unless the CPU upcast applies
        if backend == "triton":  # one kernel over all tokens: logits never leave the chip
            partials = fused_partials(x.to(dtype), w, local_t, owned, inv_temperature, with_entropy)
        else:
            partials = _chunked_partials(x, w, local_t, owned, chunk_size, inv_temperature, with_entropy)
        logprob, lse, entropy = finalize_partials(reduce_partials(partials, tp_group))

        ctx.tp_group, ctx.chunk_size, ctx.inv_temperature = tp_group, chunk_size, inv_temperature
        ctx.reduce_grad_hidden, ctx.backend = reduce_grad_hidden, backend
        ctx.save_for_backward(hidden, weight, local_t, owned, lse, entropy if with_entropy else None)
        out_entropy = entropy.reshape(target.shape) if with_entropy else logprob.new_empty(0)
        if not with_entropy:
            ctx.mark_non_differentiable(out_entropy)
        return logprob.reshape(target.shape), out_entropy

    @staticmethod
    def backward(ctx, grad_logprob, grad_entropy):
        hidden, weight, local_t, owned, lse, entropy = ctx.saved_tensors
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        x = hidden.reshape(-1, hidden.shape[-1])
        dtype = compute_dtype(x)
        w = weight.to(dtype)
        g_lp = None if grad_logprob is None else grad_logprob.reshape(-1).to(lse.dtype)
        use_h = grad_entropy is not None and entropy is not None
        g_h = grad_entropy.reshape(-1).to(lse.dtype) if use_h else None
        rows = min(ctx.chunk_size, x.shape[0])
        n_scratch = 2 if use_h and ctx.backend == "torch" else 1
        buf, *scratch = _workspace(rows, w.shape[0], lse.dtype, x.device, n_scratch)

        grad_x = torch.empty(x.shape, dtype=dtype, device=x.device) if need_x else None
        grad_w = None
        for sl in chunk_slices(x.shape[0], ctx.chunk_size):
            x_c = x[sl].to(dtype)
            z = chunk_logits(x_c, w, ctx.inv_temperature, buf)
            args = (local_t[sl], owned[sl], lse[sl], None if g_lp is None else g_lp[sl],
                    entropy[sl] if use_h else None, g_h[sl] if use_h else None)
            if ctx.backend == "triton":
                dz = logits_grad_triton_(z, *args, ctx.inv_temperature)
            else:
                dz = logits_grad_(z, *args, *scratch)
                if ctx.inv_temperature != 1.0:
                    dz.mul_(ctx.inv_temperature)  # z = (x W^T) / T
            dz = dz.to(dtype)  # no-op on CPU; bf16 operands for the GPU GEMMs
            grad_w = add_chunk_grads(dz, w, x_c, grad_x[sl] if need_x else None, grad_w, need_w)
        del buf, scratch
        if need_w and grad_w is None:  # no tokens
            grad_w = torch.zeros(weight.shape, dtype=lse.dtype, device=weight.device)

        if need_x and ctx.reduce_grad_hidden:
            grad_x = all_reduce_sum(grad_x, ctx.tp_group)  # each rank holds its vocab shard's share of dX
        grad_x = None if grad_x is None else grad_x.to(hidden.dtype).reshape(hidden.shape)
        grad_w = None if grad_w is None else grad_w.to(weight.dtype)
        return grad_x, grad_w, None, None, None, None, None, None, None


def _chunked_partials(x, w, local_t, owned, chunk_size, inv_temperature, with_entropy) -> SoftmaxPartials:
    """Softmax partials ``[N]`` of all tokens, one ``[chunk, V/TP]`` fp32 workspace (two with entropy) reused."""
    dtype = w.dtype
    rows = min(chunk_size, x.shape[0])
    buf, *scratch = _workspace(rows, w.shape[0], acc_dtype(dtype), x.device, 2 if with_entropy else 1)
    parts: list[SoftmaxPartials] = []
    for sl in chunk_slices(x.shape[0], chunk_size):
        z = chunk_logits(x[sl].to(dtype), w, inv_temperature, buf)
        parts.append(chunk_partials_(z, local_t[sl], owned[sl], with_entropy, *scratch))
    if not parts:  # no tokens
        empty = buf.new_empty(0)
        return SoftmaxPartials(empty, empty, empty, empty if with_entropy else None)
    return SoftmaxPartials(*(None if f[0] is None else torch.cat(f) for f in zip(*parts)))


def check_head_inputs(
    hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, temperature: float, chunk_size: Optional[int]
) -> int:
    """Raise ValueError naming the argument unless the shapes and settings of an LM-head call agree; returns the chunk
    size in tokens (``default_chunk_size`` of the shard when ``chunk_size`` is None)."""
    if hidden.shape[:-1] != target.shape:
        raise ValueError(f"hidden {tuple(hidden.shape)} and target {tuple(target.shape)} disagree on [...] dims")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight {tuple(weight.shape)} must be [V/TP, H] with H = {hidden.shape[-1]}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    chunk = default_chunk_size(weight.shape[0]) if chunk_size is None else chunk_size
    if chunk < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    return chunk


def fused_linear_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    tp_group: Optional[ProcessGroup] = None,
    *,
    chunk_size: Optional[int] = None,
    temperature: float = 1.0,
    with_entropy: bool = False,
    sequence_parallel: bool = False,
    backend: str = "torch",
):
    """Log-prob of ``target`` under ``softmax(hidden @ W.T / temperature)`` with W's rows sharded over ``tp_group``.

    Args:
        hidden: ``[..., H]`` final hidden states, identical on every TP rank; with ``sequence_parallel`` this rank's
            ``[n_local, ..., H]`` shard of dim 0 (all-gathered here; ``target`` must then be the gathered ``[n, ...]``).
        weight: ``[V/TP, H]`` this rank's LM-head rows (global ids ``[r V/TP, (r+1) V/TP)``).
        target: long ``[...]`` global token ids (an id outside ``[0, V)`` gives ``-lse``).
        tp_group: the vocab-parallel group; None = the whole vocab is local (no communication).
        chunk_size: tokens per chunk; bounds the extra memory to O(chunk_size x V/TP). None: ``default_chunk_size``.
        temperature: logits are divided by it (sampling temperature of the rollout engine).
        with_entropy: also return the full-vocab entropy per token (differentiable).
        sequence_parallel: ``hidden`` is sharded over TP along dim 0 (Megatron sequence parallelism).
        backend: "torch" (chunked GEMMs + allocation-free elementwise chunk math, any device) or "triton" (CUDA:
            the forward never materialises logits; the backward's elementwise pass is one kernel). "triton" is
            opt-in until it has been validated on a GPU (see kernels/triton_logprob.py).

    Returns:
        fp32 ``[...]`` log-probs, or ``(logprobs, entropy)`` when ``with_entropy``. Differentiable w.r.t. ``hidden``
        (full gradient on every rank; the shard's under ``sequence_parallel``) and ``weight`` (this shard's rows).
    """
    if sequence_parallel:
        # all_gather's backward is the reduce-scatter of the per-rank partial dX: no second all-reduce inside.
        hidden = all_gather(hidden, tp_group, dim=0)
    chunk = check_head_inputs(hidden, weight, target, temperature, chunk_size)
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "triton" and not triton_usable(hidden.device):
        raise ValueError("backend='triton' needs a CUDA device and an importable triton")
    logprob, entropy = _FusedLinearLogprob.apply(
        hidden, weight, target, tp_group, chunk, 1.0 / temperature, with_entropy, not sequence_parallel, backend
    )
    return (logprob, entropy) if with_entropy else logprob


__all__ = [
    "BACKENDS", "DEFAULT_CHUNK_BYTES", "add_chunk_grads", "check_head_inputs", "chunk_logits", "compute_dtype",
    "default_chunk_size", "fused_linear_logprobs", "mm_fp32",
]
