"""The fp32 reference of the whole benchmark problem: loss, dX and dW, written out by hand, chunked over tokens.

Independent of every path it checks (no fused code, no autograd through the head): for every chunk of tokens

    z   = X_c W^T                    logits, fp32 [chunk, V]  (or the inputs' dtype when wider: fp64 stays fp64)
    lp  = z[t] - logsumexp(z)        the log-prob of the target

then the plugin loss on all ``lp [N]`` (autograd on those N values only) gives ``g = dL/dlp``, and a second pass

    dz  = g (onehot(t) - softmax(z))      dL/dz
    dX_c = dz W,   dW += dz^T X_c

bf16 / fp16 inputs are upcast, so the reference sees the same input values as the paths and differs from them only by
their arithmetic. Matmuls run in true fp32 (TF32 off for the duration). Memory: one ``[chunk, V]`` block (about
``chunk_bytes``), an fp32 copy of W and the fp32 dW.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from nemo_is_plugin.apps.bench.problem import HeadProblem, target_logprobs

REFERENCE_CHUNK_BYTES = 2**30


@dataclass
class Reference:
    loss: torch.Tensor  # 0-d
    grad_hidden: torch.Tensor  # [N, H]
    grad_weight: torch.Tensor  # [V, H]


@contextlib.contextmanager
def exact_fp32_matmul():
    """TF32 off inside the block (a 10-bit mantissa would make the reference worse than a bf16 path's fp32 parts)."""
    if not torch.cuda.is_available():
        yield
        return
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


def reference_loss_and_grads(problem: HeadProblem, loss_fn, chunk_bytes: int = REFERENCE_CHUNK_BYTES) -> Reference:
    """fp32 (fp64 for fp64 inputs) loss, ``d loss / d hidden [N, H]`` and ``d loss / d weight [V, H]``."""
    h = problem.hidden.shape[-1]
    dt = torch.promote_types(problem.hidden.dtype, torch.float32)
    x, t = problem.hidden.reshape(-1, h), problem.target.reshape(-1)
    w = problem.weight.to(dt)
    n, v = x.shape[0], w.shape[0]
    rows = max(1, chunk_bytes // (v * w.element_size()))
    chunks = [slice(s, min(s + rows, n)) for s in range(0, n, rows)]
    with exact_fp32_matmul():
        lp = target_logprobs(problem.hidden, w, problem.target, chunk_bytes)
    leaf = lp.requires_grad_(True)
    loss, _ = loss_fn(
        next_token_logprobs=leaf,
        data=problem.data,
        global_valid_seqs=problem.global_valid_seqs,
        global_valid_toks=problem.global_valid_toks,
    )
    (g,) = torch.autograd.grad(loss, leaf)
    g = g.reshape(-1).to(dt)
    with exact_fp32_matmul(), torch.no_grad():
        dx = torch.empty(n, h, dtype=dt, device=x.device)
        dw = torch.zeros(v, h, dtype=dt, device=x.device)
        for c in chunks:
            xc = x[c].to(dt)
            dz = torch.softmax(xc @ w.t(), dim=-1).mul_(-g[c, None])
            dz.scatter_add_(1, t[c, None], g[c, None])
            torch.mm(dz, w, out=dx[c])
            dw.addmm_(dz.t(), xc)
    return Reference(loss.detach(), dx, dw)


def rel_err(got: torch.Tensor | None, want: torch.Tensor, block_rows: int = 8192) -> float | None:
    """``max |got - want| / max |want|`` (None when ``got`` is None), computed in row blocks in ``want``'s dtype so
    that a V x H comparison does not need a full-size temporary; one host sync."""
    if got is None:
        return None
    got2, want2 = got.reshape(want.shape[0], -1), want.reshape(want.shape[0], -1)
    diff = torch.zeros((), dtype=want.dtype, device=want.device)
    scale = torch.zeros((), dtype=want.dtype, device=want.device)
    for s in range(0, want2.shape[0], block_rows):
        a, b = got2[s : s + block_rows].to(want.dtype), want2[s : s + block_rows]
        diff = torch.maximum(diff, (a - b).abs().max())
        scale = torch.maximum(scale, b.abs().max())
    return (diff / scale.clamp_min(torch.finfo(want.dtype).tiny)).item()


def compare(
    loss: torch.Tensor, grad_hidden: torch.Tensor | None, grad_weight: torch.Tensor | None, ref: Reference
) -> dict:
    """``loss_err`` (relative), ``dx_err`` and ``dw_err`` (max-relative, see :func:`rel_err`) of one path's run."""
    loss_err = ((loss.detach().to(ref.loss.dtype) - ref.loss).abs() / ref.loss.abs().clamp_min(1e-30)).item()
    shape_x = ref.grad_hidden.shape
    dx = None if grad_hidden is None else grad_hidden.reshape(shape_x)
    return dict(loss_err=loss_err, dx_err=rel_err(dx, ref.grad_hidden), dw_err=rel_err(grad_weight, ref.grad_weight))


__all__ = ["REFERENCE_CHUNK_BYTES", "Reference", "compare", "exact_fp32_matmul", "reference_loss_and_grads", "rel_err"]
