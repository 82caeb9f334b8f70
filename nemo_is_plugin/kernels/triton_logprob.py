"""Triton kernels (CUDA) for the two elementwise passes over a chunk of logits; the GEMMs around them are cuBLAS.

The kernels are tested through Triton's interpreter on CPU (``TRITON_INTERPRET=1``, tiny shapes:
tests/kernels/test_triton_chunk_kernels.py), which checks their indexing and math, and compiled and run on a GPU by
the same checks in the ``gpu`` tier. The block sizes below were measured on an H100 (``bench/kernel_sweep.py``).

Both kernels read the chunk ``z [n, V/TP]`` in the GEMM's output dtype (bf16 for bf16 inputs: the values the naive
bf16 path's logits have), upcast each element to fp32 in registers and multiply it by ``in_scale`` (1 / temperature),
so no pass over the chunk is spent on upcasting or scaling.

- ``partials`` (pass 1): one program per row loops over the row in ``BLOCK_V`` blocks and keeps the online softmax
  statistics (max m, sum exp(z - m), and sum exp(z - m)(z - m) for the entropy) as fp32 scalars; the target logit is
  one scalar load (column -1 = another TP rank owns it: 0). Reads the chunk once (2 B/element in bf16), writes
  3-4 floats per row.
- ``logits_grad`` (pass 2): a 2-D grid (row, column block); each program recomputes p = exp(z s - lse) from the global
  lse and writes ``dz = out_scale (g (onehot - p) - h p (log p + H))`` in the output dtype, in place over z or into
  another buffer. Reads 2 B and writes 2 B per element in bf16.

Block sizes (``BLOCKS``), measured on an H100 80GB (torch 2.11, triton 3.6; ``python -m
nemo_is_plugin.apps.bench.kernel_sweep``: a bf16 chunk of 2048 rows x 151,936 columns, median of 10 launches):

- pass 1 streams a row in blocks of ``min(partials_block_v, next_pow2(V/TP))`` columns with one warp per 1024
  columns (32 elements per thread, four 16-byte loads in bf16), halving the block with the entropy term. 8192 columns
  / 8 warps: 0.287 ms (2.17 TB/s), 4096 / 4 with the entropy term: 0.266 ms; the 32768 / 32 first reasoned from
  Liger's cross-entropy kernel took 0.324 ms and 0.376 ms (entropy). (Likely why: shorter blocks keep more programs
  resident per SM, which hides each block's serial online-softmax reduction; not profiled.)
- pass 2 has no row-wide state: a 2-D grid of (row, 8192-column block) programs with 16 warps (16 elements per
  thread), no loop and no reduction: 0.485 ms (2.57 TB/s, reading and writing the chunk), 4096 / 8 took 0.547 ms.

The numbers are fields of one dataclass so that a GPU run can sweep them (the benchmark records them).

Compilation is separate from launching. Every specialisation (dtypes, pointer alignment, the integers Triton
specialises on, constexprs, warps) is compiled and loaded onto the device with ``JITFunction.warmup`` before its
first launch; whatever fails there is raised as :class:`TritonCompileError` (the only error the ``auto`` backend may
fall back on, :mod:`kernels.chunk_math`). The launch itself is never wrapped: its errors propagate as they are.
``compile_kernels`` compiles what one LM-head call launches before the call sizes its chunks.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from nemo_is_plugin.kernels.softmax_partials import SoftmaxPartials

try:  # triton is optional (CUDA builds of torch ship it; the `liger` extra pulls it in)
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is absent
    triton = None

# dtypes of the chunk the kernels accept (fp64 stays on the torch backend)
TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass
class TritonBlocks:
    """Launch parameters of the two kernels (powers of two; see the module docstring for the reasoning)."""

    partials_block_v: int = 8192  # an upper bound: rows narrower than this take next_pow2(row) columns
    partials_warps: int = 8  # an upper bound: one warp per 1024 columns of the block
    grad_block_v: int = 8192
    grad_warps: int = 16

    def partials_launch(self, n_cols: int, with_entropy: bool = False) -> tuple[int, int]:
        """(block, warps) of pass 1 for rows of ``n_cols`` columns: 32 elements per thread; half the block with the
        entropy term (one more block-wide value live; measured faster)."""
        cap = self.partials_block_v // (2 if with_entropy else 1)
        block = min(cap, 1 << max(0, n_cols - 1).bit_length())
        return block, max(1, min(self.partials_warps, block // 1024))


BLOCKS = TritonBlocks()


def triton_usable(device: torch.device) -> bool:
    """True on a CUDA device with triton importable, or anywhere under ``TRITON_INTERPRET=1`` (tests)."""
    if triton is None:
        return False
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


if triton is not None:

    @triton.jit
    def _partials_kernel(
        Z,
        stride_z,
        TGT,
        M_OUT,
        S_OUT,
        T_OUT,
        Q_OUT,
        n_cols,
        in_scale,
        WITH_ENTROPY: tl.constexpr,
        BLOCK_V: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        base = Z + row * stride_z
        m = float("-inf")
        s = 0.0
        q = 0.0
        for v0 in range(0, n_cols, BLOCK_V):
            cols = v0 + tl.arange(0, BLOCK_V)
            mask = cols < n_cols
            z = tl.load(base + cols, mask=mask, other=float("-inf")).to(tl.float32) * in_scale
            new_m = tl.maximum(m, tl.max(z, axis=0))
            alpha = tl.exp(m - new_m)  # first block: exp(-inf) = 0, nothing to rescale
            e = tl.exp(z - new_m)  # columns past the row: exp(-inf) = 0
            if WITH_ENTROPY:
                delta = tl.where(m == float("-inf"), 0.0, m - new_m)  # no -inf * 0 on the first block
                shifted = tl.where(mask, z - new_m, 0.0)  # past the row: e = 0 and no 0 * -inf
                q = alpha * (q + delta * s) + tl.sum(e * shifted, axis=0)
            s = alpha * s + tl.sum(e, axis=0)
            m = new_m
        tgt = tl.load(TGT + row)  # local column, -1 when another TP rank owns the target
        t = tl.load(base + tl.maximum(tgt, 0)).to(tl.float32) * in_scale
        tl.store(M_OUT + row, m)
        tl.store(S_OUT + row, s)
        tl.store(T_OUT + row, tl.where(tgt >= 0, t, 0.0))
        if WITH_ENTROPY:
            tl.store(Q_OUT + row, q)

    @triton.jit
    def _logits_grad_kernel(
        Z,
        stride_z,
        OUT,
        stride_out,
        TGT,
        LSE,
        G,
        ENT,
        HG,
        n_cols,
        in_scale,
        out_scale,
        HAS_G: tl.constexpr,
        HAS_H: tl.constexpr,
        BLOCK_V: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
        mask = cols < n_cols
        z = tl.load(Z + row * stride_z + cols, mask=mask, other=0.0).to(tl.float32) * in_scale
        logp = z - tl.load(LSE + row)
        p = tl.exp(logp)
        grad = tl.zeros((BLOCK_V,), tl.float32)
        if HAS_G:
            g = tl.load(G + row)
            grad = tl.where(cols == tl.load(TGT + row), g, 0.0) - g * p
        if HAS_H:
            grad -= tl.load(HG + row) * p * (logp + tl.load(ENT + row))
        out = (grad * out_scale).to(OUT.dtype.element_ty)  # round to nearest even
        tl.store(OUT + row * stride_out + cols, out, mask=mask)


class TritonCompileError(RuntimeError):
    """A kernel specialisation failed to compile, or to load onto the device, before its first launch."""


_COMPILED: set[tuple] = set()  # specialisations compiled in this process (their launches are not gated again)


def _specialisation(kernel, args: tuple, kwargs: dict) -> tuple:
    """What Triton compiles one binary per: the current device, tensor dtypes and 16-byte alignment, integers equal
    to 1 or divisible by 16, the constexprs and launch options. A ``torch.dtype`` stands for an aligned tensor
    (``warmup``'s mock)."""
    device = torch.cuda.current_device() if torch.cuda.is_available() else None  # Triton compiles for this one
    parts: list = [getattr(kernel, "__name__", repr(kernel)), device]
    for a in args:
        if isinstance(a, torch.Tensor):
            parts.append((a.dtype, a.data_ptr() % 16 == 0))
        elif isinstance(a, torch.dtype):
            parts.append((a, True))
        elif isinstance(a, bool) or not isinstance(a, int):
            parts.append(type(a).__name__)
        else:
            parts.append((a == 1, a % 16 == 0))
    return (*parts, *sorted(kwargs.items()))


def _compile(kernel, grid: tuple, args: tuple, kwargs: dict) -> None:
    """Compile the specialisation ``args`` select and load it onto the device, without launching it."""
    compiled = kernel.warmup(*args, grid=grid, **kwargs)  # None under the interpreter: nothing to compile
    load = getattr(compiled, "_init_handles", None)  # loading is where a kernel too large for the device is refused
    if load is not None:
        load()


def _ensure_compiled(kernel, grid: tuple, args: tuple, kwargs: dict) -> None:
    """Compile the specialisation once per process; any failure is a :class:`TritonCompileError`."""
    key = _specialisation(kernel, args, kwargs)
    if key in _COMPILED:
        return
    try:
        _compile(kernel, grid, args, kwargs)
    except Exception as exc:
        name = getattr(kernel, "__name__", "kernel")
        raise TritonCompileError(f"{name} failed to compile: {type(exc).__name__}: {exc}") from exc
    _COMPILED.add(key)


def _run(kernel, grid: tuple, args: tuple, kwargs: dict) -> None:
    kernel[grid](*args, **kwargs)


def _launch(kernel, grid: tuple, args: tuple, kwargs: dict) -> None:
    """Compile before the first launch of a specialisation (errors: TritonCompileError), then launch (errors: as
    raised)."""
    _ensure_compiled(kernel, grid, args, kwargs)
    _run(kernel, grid, args, kwargs)


def _partials_args(z, stride_z: int, target_column, m, s, t, q, n_cols: int, in_scale: float, with_entropy: bool):
    """Positional arguments and keywords (constexprs, warps) of ``_partials_kernel``, in its signature's order."""
    block, warps = BLOCKS.partials_launch(n_cols, with_entropy)
    args = (z, stride_z, target_column, m, s, t, q, n_cols, float(in_scale))
    return args, dict(WITH_ENTROPY=with_entropy, BLOCK_V=block, num_warps=warps)


def _grad_args(z, strides: tuple[int, int], out, vectors: tuple, n_cols: int, scales: tuple[float, float], flags):
    """Positional arguments and keywords of ``_logits_grad_kernel``; ``vectors`` = (target column, lse, g, entropy,
    h), ``flags`` = (HAS_G, HAS_H)."""
    args = (z, strides[0], out, strides[1], *vectors, n_cols, float(scales[0]), float(scales[1]))
    kwargs = dict(HAS_G=flags[0], HAS_H=flags[1], BLOCK_V=BLOCKS.grad_block_v, num_warps=BLOCKS.grad_warps)
    return args, kwargs


def compile_kernels(dtype: torch.dtype, n_cols: int, with_entropy: bool) -> None:
    """Compile (no launch) the specialisations one LM-head call over row-major ``[n, n_cols]`` chunks of ``dtype``
    launches: pass 1 (``with_entropy``) and pass 2 with the upstream gradients that call can receive. Raises
    TritonCompileError. Run before the call sizes its chunk, so that a fallback can size it for the torch backend."""
    if triton is None:
        raise TritonCompileError("triton is not importable")
    f32, i64 = torch.float32, torch.int64
    args, kwargs = _partials_args(dtype, n_cols, i64, f32, f32, f32, f32, n_cols, 1.0, with_entropy)
    _ensure_compiled(_partials_kernel, (1,), args, kwargs)
    for flags in [(True, False)] + ([(True, True), (False, True)] if with_entropy else []):
        vectors = (i64, f32, f32, f32, f32)
        args, kwargs = _grad_args(dtype, (n_cols, n_cols), dtype, vectors, n_cols, (1.0, 1.0), flags)
        _ensure_compiled(_logits_grad_kernel, (1, 1), args, kwargs)


class ChunkLayoutError(ValueError):
    """A launcher's argument the kernels cannot take (dtype, strides): the caller's error, not a kernel failure."""


def _check_chunk(z: torch.Tensor, name: str) -> None:
    if z.dim() != 2 or z.dtype not in TRITON_DTYPES or (z.shape[1] > 1 and z.stride(1) != 1):
        raise ChunkLayoutError(
            f"{name} needs a row-major [n, v] chunk of {TRITON_DTYPES}, got {z.dtype} {tuple(z.shape)}"
        )


def triton_partials(
    z: torch.Tensor, target_column: torch.Tensor, in_scale: float, with_entropy: bool, out: SoftmaxPartials
) -> SoftmaxPartials:
    """Pass 1 over ``z [n, v]`` (not modified): the softmax partials of ``z * in_scale`` written into ``out``'s
    fp32 ``[n]`` fields (contiguous). Same values as ``chunk_inplace.chunk_partials_`` on the fp32 logits."""
    _check_chunk(z, "triton_partials")
    n, v = z.shape
    if n == 0:
        return out
    if any(f is not None and f.stride(0) != 1 for f in out):
        raise ChunkLayoutError("triton_partials writes contiguous [n] outputs")
    q_out = out.sum_zexp if with_entropy else out.max  # a valid pointer when WITH_ENTROPY is off
    args, kwargs = _partials_args(
        z, z.stride(0), target_column.contiguous(), out.max, out.sumexp, out.target, q_out, v, in_scale, with_entropy
    )
    _launch(_partials_kernel, (n,), args, kwargs)
    return out


def triton_logits_grad(
    z: torch.Tensor,
    out: torch.Tensor,
    target_column: torch.Tensor,
    lse: torch.Tensor,
    grad_logprob: torch.Tensor | None,
    entropy: torch.Tensor | None,
    grad_entropy: torch.Tensor | None,
    in_scale: float,
    out_scale: float,
) -> torch.Tensor:
    """Pass 2: ``out = out_scale (g (onehot - p) - h p (log p + H))`` with ``p = exp(z in_scale - lse)``; ``out`` may
    be ``z`` itself (in place) and has any of the accepted dtypes. Per-token vectors are fp32 ``[n]``."""
    _check_chunk(z, "triton_logits_grad")
    _check_chunk(out, "triton_logits_grad (out)")
    n, v = z.shape
    if n == 0 or v == 0:
        return out
    has_g, has_h = grad_logprob is not None, grad_entropy is not None and entropy is not None
    # the kernel indexes per-row vectors with stride 1: upstream gradients may arrive expanded (stride 0)
    lse, target_column = lse.contiguous(), target_column.contiguous()
    g = lse if grad_logprob is None else grad_logprob.contiguous()  # lse: a valid pointer for a disabled input
    ent, h = (lse, lse)
    if entropy is not None and grad_entropy is not None:
        ent, h = entropy.contiguous(), grad_entropy.contiguous()
    strides = (z.stride(0), out.stride(0))
    vectors = (target_column, lse, g, ent, h)
    args, kwargs = _grad_args(z, strides, out, vectors, v, (in_scale, out_scale), (has_g, has_h))
    _launch(_logits_grad_kernel, (n, triton.cdiv(v, BLOCKS.grad_block_v)), args, kwargs)
    return out


__all__ = [
    "BLOCKS",
    "TRITON_DTYPES",
    "ChunkLayoutError",
    "TritonBlocks",
    "TritonCompileError",
    "compile_kernels",
    "triton_logits_grad",
    "triton_partials",
    "triton_usable",
]
