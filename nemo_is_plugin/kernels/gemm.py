"""The GEMMs of the fused LM-head paths: dtypes, the chunk's logits, and the weight-gradient accumulator.

Shapes: ``x [n, H]`` (a chunk of hidden states), ``weight [V/TP, H]``, logits / ``dz [n, V/TP]``, ``dW [V/TP, H]``.

Precision policy (why each dtype):

- compute dtype (GEMM operands and output): fp32 on CPU for bf16/fp16 inputs (a bf16 CPU GEMM is ~100x slower than
  fp32), the input dtype elsewhere. On a GPU the logits ``x W^T`` therefore come out in bf16 for bf16 inputs: exactly
  the values the naive bf16 path's logits have. cuBLAS accumulates every product in fp32 either way.
- accumulation dtype (softmax statistics, loss arithmetic): fp32, or fp64 for fp64 inputs.
- dW accumulator (``WeightGrad``): each chunk's ``dz^T x_c`` is one GEMM with fp32 accumulation that adds into the
  accumulator in place (cuBLAS beta = 1, no V x H temporary), in one of three dtypes:

  * the weight's dtype (the GPU default): dW costs its own size; the running sum is rounded to bf16 once per chunk,
    so with k chunks its error is at most k roundings (~k 2^-9 relative; typically ~sqrt(k) 2^-9) instead of the
    naive path's one;
  * fp32 (the CPU default, or ``grad_weight_dtype=torch.float32``): exact chunk sums in fp32, rounded to the
    weight's dtype once at the end; needs a ``V/TP x H`` fp32 buffer (2x a bf16 dW) plus the final cast;
  * a caller's buffer (``grad_weight_out``, e.g. Megatron's fp32 ``main_grad``): the chunks are added straight into
    it; no dW is returned. Low-precision operands into an fp32 buffer use ``addmm(..., out_dtype=torch.float32,
    out=buf)`` (one GEMM, fp32 C read and written by the epilogue) where torch supports it, else the product of a
    block of rows in the operand dtype added in fp32 (one rounding per chunk and entry, temporaries of 256 MiB).
    The switch to the blocked product happens only when torch says the ``out_dtype`` kernel does not exist
    (``mixed_addmm_unsupported``), with a warning, once per (device type, dtypes); any other error of the GEMM (an
    out-of-memory first of all) propagates and switches nothing.
"""

from __future__ import annotations

import warnings

import torch

# Row blocks of the fallback product ``a @ b`` added into an accumulator of another dtype: bounds its temporary.
FALLBACK_BLOCK_BYTES = 256 * 2**20
_MIXED_ADDMM: dict[tuple[str, torch.dtype, torch.dtype], bool] = {}  # (device, operand, acc) -> out_dtype works


def compute_dtype(tensor: torch.Tensor) -> torch.dtype:
    """dtype the GEMMs run in: fp32 on CPU (bf16/fp16 CPU GEMMs are ~100x slower), the input dtype elsewhere."""
    if tensor.device.type == "cpu" and tensor.dtype in (torch.bfloat16, torch.float16):
        return torch.float32
    return tensor.dtype


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """dtype of the softmax statistics and of the loss arithmetic: fp32, or fp64 for fp64 inputs."""
    return torch.promote_types(dtype, torch.float32)


def chunk_logits(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Raw logits of one chunk, ``x [n, H] @ weight[V/TP, H].T``, written into ``out[:n]`` (returned).

    ``x``, ``weight`` and ``out`` are in the compute dtype (the temperature is applied by the chunk kernels)."""
    return torch.mm(x, weight.t(), out=out[: x.shape[0]])


def mixed_addmm_unsupported(exc: BaseException) -> bool:
    """True when ``exc`` from ``addmm(..., out_dtype=)`` says this torch / device has no such kernel: a TypeError (a
    torch without the keyword), a NotImplementedError (no ``aten::addmm.dtype_out`` kernel for the backend, e.g.
    CPU), or a RuntimeError whose message is about ``out_dtype`` (an unsupported dtype pair). An out-of-memory, or
    any other error, is not: it must propagate."""
    if isinstance(exc, torch.cuda.OutOfMemoryError):
        return False
    if isinstance(exc, (TypeError, NotImplementedError)):
        return True
    return isinstance(exc, RuntimeError) and ("out_dtype" in str(exc) or "dtype_out" in str(exc))


def addmm_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``acc += a @ b`` in place, the product accumulated in fp32 (fp64) inside the GEMM (see module docstring)."""
    if acc.dtype == a.dtype:
        return acc.addmm_(a, b)
    key = (acc.device.type, a.dtype, acc.dtype)
    if _MIXED_ADDMM.get(key, acc.device.type != "cpu"):
        try:
            return torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
        except (RuntimeError, TypeError, NotImplementedError) as exc:
            if not mixed_addmm_unsupported(exc):
                raise
            _MIXED_ADDMM[key] = False  # this torch / device has no such kernel: blocked product from now on
            why = (str(exc).splitlines() or [""])[0][:200]
            warnings.warn(
                f"addmm(out_dtype={acc.dtype}) is not available for {a.dtype} operands on {acc.device.type} "
                f"({type(exc).__name__}: {why}); the weight gradient is accumulated with the blocked product from "
                "now on (one rounding per chunk and entry)",
                RuntimeWarning,
                stacklevel=3,
            )
    rows = max(1, FALLBACK_BLOCK_BYTES // max(1, b.shape[1] * a.element_size()))
    for r0 in range(0, a.shape[0], rows):
        acc[r0 : r0 + rows].add_(torch.mm(a[r0 : r0 + rows], b))
    return acc


class WeightGrad:
    """``dW = sum over chunks of dz_c^T x_c`` for one call (see the module docstring for the three dtypes).

    Args:
        weight: the LM-head shard (shape, dtype and device of the result).
        dtype: the accumulator's dtype (ignored when ``out`` is given).
        out: a caller's ``[V/TP, H]`` buffer the chunks are added into (its content is kept: ``out += dW``).
    """

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype, out: torch.Tensor | None = None):
        self.shape, self.weight_dtype, self.device = weight.shape, weight.dtype, weight.device
        self.out = out
        self.dtype = dtype if out is None else out.dtype
        self.buf: torch.Tensor | None = out

    def add(self, dz: torch.Tensor, x_c: torch.Tensor) -> None:
        """``dW += dz^T x_c`` (``dz [n, V/TP]``, ``x_c [n, H]``, both in the compute dtype)."""
        a = dz.t()
        if self.buf is None and self.dtype == a.dtype:
            self.buf = torch.mm(a, x_c)  # the first chunk writes the accumulator: no zero-fill pass over V x H
            return
        if self.buf is None:
            self.buf = torch.zeros(self.shape, dtype=self.dtype, device=self.device)
        addmm_(self.buf, a, x_c)

    def result(self) -> torch.Tensor | None:
        """The weight's gradient in its dtype; None when it was accumulated into ``out``."""
        if self.out is not None:
            return None
        if self.buf is None:  # no tokens
            return torch.zeros(self.shape, dtype=self.weight_dtype, device=self.device)
        return self.buf.to(self.weight_dtype)


def default_grad_weight_dtype(weight: torch.Tensor, requested: torch.dtype | None) -> torch.dtype:
    """The dW accumulator's dtype: ``requested``, else fp32 (fp64 for fp64) on CPU and the weight's dtype elsewhere."""
    if requested is not None:
        return requested
    return acc_dtype(weight.dtype) if weight.device.type == "cpu" else weight.dtype


__all__ = [
    "WeightGrad",
    "acc_dtype",
    "addmm_",
    "chunk_logits",
    "compute_dtype",
    "default_grad_weight_dtype",
    "mixed_addmm_unsupported",
]
