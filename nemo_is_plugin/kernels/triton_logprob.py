"""Triton kernels (CUDA) for the fused-linear log-prob: a forward that never writes logits to memory, and the
in-place per-chunk logits gradient of the recomputing backward.

STATUS: no GPU was available while this was written. Both kernels are tested only through Triton's interpreter
(``TRITON_INTERPRET=1``, numpy on CPU, tiny shapes: tests/distributed/test_fused_linear_triton.py), which checks their
indexing and math but not compilation for, or speed on, a real GPU. Block sizes are untuned guesses.

Forward (``fused_partials``): grid = (token blocks, vocab splits). Each program computes its ``[BLOCK_N, BLOCK_V]``
logit tiles with ``tl.dot`` over H in ``BLOCK_K`` steps (fp32 accumulation), scales them by 1/temperature and folds
them into running softmax partials (max m, sum exp(z - m), target logit, sum exp(z - m)(z - m)), so only
``4 x [splits, N]`` floats are written. The splits are merged on the host with vocab_parallel's shift identity;
the TP merge that follows is vocab_parallel's as well.

Backward (``logits_grad_triton_``): one elementwise pass over a recomputed fp32 chunk ``z [n, V/TP]``, in place:
``dz = (g (onehot - p) - h p (log p + H)) / temperature`` with ``p = exp(z - lse)``; the chunk GEMMs around it
(recompute, dX, dW) stay cuBLAS calls in ``distributed/fused_linear.py``.
"""

from __future__ import annotations

import os
from typing import Optional

import torch

from nemo_is_plugin.distributed.vocab_parallel import SoftmaxPartials, rescale_partials

try:  # triton is optional (the `liger` extra pulls it in; CUDA builds of torch ship it)
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is absent
    triton = None


def triton_usable(device: torch.device) -> bool:
    """True on a CUDA device with triton importable, or anywhere under ``TRITON_INTERPRET=1`` (tests)."""
    if triton is None:
        return False
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


if triton is not None:

    @triton.jit
    def _partials_kernel(
        X, W, TGT, M_OUT, S_OUT, T_OUT, Q_OUT,
        N, V, H, stride_x, stride_w, inv_temperature,
        SPLIT_V: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
        WITH_ENTROPY: tl.constexpr, FP32_EXACT: tl.constexpr,
    ):
        pid_n, pid_s = tl.program_id(0), tl.program_id(1)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = rn < N
        tgt = tl.load(TGT + rn, mask=n_mask, other=-1)  # local column, -1 when another rank owns the target
        m = tl.full((BLOCK_N,), float("-inf"), tl.float32)
        s = tl.zeros((BLOCK_N,), tl.float32)
        t = tl.zeros((BLOCK_N,), tl.float32)
        q = tl.zeros((BLOCK_N,), tl.float32)
        for v_off in range(0, SPLIT_V, BLOCK_V):
            rv = pid_s * SPLIT_V + v_off + tl.arange(0, BLOCK_V)
            v_mask = rv < V
            acc = tl.zeros((BLOCK_N, BLOCK_V), tl.float32)
            for k0 in range(0, H, BLOCK_K):
                rk = k0 + tl.arange(0, BLOCK_K)
                k_mask = rk < H
                x = tl.load(X + rn[:, None] * stride_x + rk[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
                w = tl.load(W + rv[:, None] * stride_w + rk[None, :], mask=v_mask[:, None] & k_mask[None, :], other=0.0)
                if FP32_EXACT:  # fp32 inputs: no TF32 rounding, the parity tests hold at 1e-5
                    acc += tl.dot(x, tl.trans(w), input_precision="ieee")
                else:  # bf16 / fp16 inputs: tensor-core MMA with fp32 accumulation
                    acc += tl.dot(x, tl.trans(w))
            z = acc * inv_temperature
            new_m = tl.maximum(m, tl.max(tl.where(v_mask[None, :], z, float("-inf")), axis=1))
            delta = tl.where(m == float("-inf"), 0.0, m - new_m)  # first tile: nothing to rescale (s = q = 0)
            alpha = tl.exp(delta)
            # masked columns (past V) get shifted = 0 and e = 0: no inf * 0 anywhere
            shifted = tl.where(v_mask[None, :], z - new_m[:, None], 0.0)
            e = tl.where(v_mask[None, :], tl.exp(shifted), 0.0)
            if WITH_ENTROPY:
                q = alpha * (q + delta * s) + tl.sum(e * shifted, axis=1)
            s = alpha * s + tl.sum(e, axis=1)
            t += tl.sum(tl.where(rv[None, :] == tgt[:, None], z, 0.0), axis=1)
            m = new_m
        out = pid_s * N + rn
        tl.store(M_OUT + out, m, mask=n_mask)
        tl.store(S_OUT + out, s, mask=n_mask)
        tl.store(T_OUT + out, t, mask=n_mask)
        if WITH_ENTROPY:
            tl.store(Q_OUT + out, q, mask=n_mask)

    @triton.jit
    def _logits_grad_kernel(
        Z, stride_z, TGT, LSE, G, ENT, HG, n_cols, inv_temperature,
        HAS_G: tl.constexpr, HAS_H: tl.constexpr, BLOCK_V: tl.constexpr,
    ):
        row, pid_v = tl.program_id(0), tl.program_id(1)
        cols = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
        mask = cols < n_cols
        logp = tl.load(Z + row * stride_z + cols, mask=mask, other=0.0) - tl.load(LSE + row)
        p = tl.exp(logp)
        grad = tl.zeros((BLOCK_V,), tl.float32)
        if HAS_G:
            g = tl.load(G + row)
            grad = tl.where(cols == tl.load(TGT + row), g, 0.0) - g * p
        if HAS_H:
            grad -= tl.load(HG + row) * p * (logp + tl.load(ENT + row))
        tl.store(Z + row * stride_z + cols, grad * inv_temperature, mask=mask)


def _owned_column(local_target: torch.Tensor, owned: torch.Tensor) -> torch.Tensor:
    return torch.where(owned, local_target, torch.full_like(local_target, -1)).contiguous()


def fused_partials(
    x: torch.Tensor,
    weight: torch.Tensor,
    local_target: torch.Tensor,
    owned: torch.Tensor,
    inv_temperature: float,
    with_entropy: bool,
    *,
    block_n: int = 64,
    block_v: int = 128,
    block_k: int = 64,
    split_v: int = 4096,
) -> SoftmaxPartials:
    """Softmax partials of ``x [N, H] @ weight[V, H].T * inv_temperature`` over this rank's vocab, fp32 ``[N]`` each.

    Same values as running ``chunk_partials`` on the materialised logits. ``split_v`` (a multiple of ``block_v``)
    sets the vocab range per program: more splits = more parallelism, more ``[splits, N]`` partials to merge.
    """
    if split_v % block_v:
        raise ValueError(f"split_v={split_v} must be a multiple of block_v={block_v}")
    x, weight = x.contiguous(), weight.contiguous()
    n, h = x.shape
    v = weight.shape[0]
    splits = triton.cdiv(v, split_v)
    out = torch.empty(4 if with_entropy else 3, splits, n, dtype=torch.float32, device=x.device)
    q_out = out[3] if with_entropy else out[0]  # unused pointer when WITH_ENTROPY is off
    grid = (triton.cdiv(n, block_n), splits)
    _partials_kernel[grid](
        x, weight, _owned_column(local_target, owned), out[0], out[1], out[2], q_out,
        n, v, h, x.stride(0), weight.stride(0), inv_temperature,
        SPLIT_V=split_v, BLOCK_N=block_n, BLOCK_V=block_v, BLOCK_K=block_k, WITH_ENTROPY=with_entropy,
        FP32_EXACT=x.dtype == torch.float32,
    )
    per_split = SoftmaxPartials(out[0], out[1], out[2], out[3] if with_entropy else None)
    global_max = out[0].amax(dim=0)  # every split holds >= 1 column: finite maxima
    merged = rescale_partials(per_split, global_max)  # [splits, N], all relative to global_max
    q = None if merged.sum_zexp is None else merged.sum_zexp.sum(0)
    return SoftmaxPartials(global_max, merged.sumexp.sum(0), merged.target.sum(0), q)


def logits_grad_triton_(
    z: torch.Tensor,
    local_target: torch.Tensor,
    owned: torch.Tensor,
    lse: torch.Tensor,
    grad_logprob: Optional[torch.Tensor],
    entropy: Optional[torch.Tensor],
    grad_entropy: Optional[torch.Tensor],
    inv_temperature: float,
    *,
    block_v: int = 1024,
) -> torch.Tensor:
    """``chunk_inplace.logits_grad_`` times ``inv_temperature``, in one pass over the fp32 chunk ``z [n, v]``."""
    if z.dtype != torch.float32 or z.stride(1) != 1:
        raise ValueError("logits_grad_triton_ needs a row-major fp32 chunk")
    n, v = z.shape
    has_h = grad_entropy is not None and entropy is not None
    dummy = lse  # pointer for the disabled inputs
    _logits_grad_kernel[(n, triton.cdiv(v, block_v))](
        z, z.stride(0), _owned_column(local_target, owned), lse.contiguous(),
        dummy if grad_logprob is None else grad_logprob.contiguous(),
        entropy.contiguous() if has_h else dummy, grad_entropy.contiguous() if has_h else dummy,
        v, inv_temperature, HAS_G=grad_logprob is not None, HAS_H=has_h, BLOCK_V=block_v,
    )
    return z


__all__ = ["fused_partials", "logits_grad_triton_", "triton_usable"]
