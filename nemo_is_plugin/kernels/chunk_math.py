"""The two elementwise passes over a chunk of logits, on the torch or the Triton backend, behind one interface.

A chunk ``z [n, V/TP]`` holds the raw logits ``x W^T`` in the GEMM's output dtype; the softmax logits are
``z * in_scale`` (``in_scale = 1 / temperature``) and the gradient handed to the GEMMs is ``dL/d(x W^T)``, i.e. the
softmax gradient times ``out_scale`` (again ``1 / temperature``):

- pass 1, :meth:`ChunkMath.partials`: per-token softmax partials of the chunk (reduced over TP by the caller);
- pass 2, :meth:`ChunkMath.logits_grad` (from z and the global lse) or :meth:`ChunkMath.single_pass_grad`
  (right after pass 1 of the same chunk; the torch backend then reuses the ``exp(z - m)`` pass 1 left behind).

Backends:

- ``"triton"`` (:mod:`kernels.triton_logprob`): reads bf16/fp16/fp32 chunks directly, one read in pass 1, one read
  and one write in pass 2; the chunk is never upcast. CUDA only (or Triton's interpreter in tests).
- ``"torch"`` (:mod:`kernels.chunk_inplace`): fp32 (fp64) math in place. A low-precision chunk (bf16 on a GPU
  without triton) is first copied into an fp32 workspace and the gradient copied back.
- ``"auto"`` (the default of the public entry points): Triton on CUDA when triton imports and the dtype is one it
  takes, torch otherwise.

Fallback (``auto`` only). Two things make ``auto`` use torch on CUDA instead of Triton: triton does not import, or a
kernel specialisation fails to compile (or to load) before its first launch (:class:`~nemo_is_plugin.kernels.
triton_logprob.TritonCompileError`). Either warns once, and this process uses torch from then on
(:func:`triton_fallback_reason` says why). Nothing else falls back: an error of a launch (an illegal address, an
out-of-memory, a bad argument), on the first launch or a later one, propagates. The fused LM-head paths compile their
kernels in :func:`resolve_backend` (``cols`` given) before they size their chunk, so a fallback there sizes the chunk
for the torch backend's fp32 workspace (:func:`~nemo_is_plugin.kernels.chunking.plan_chunks`); with their default
chunk sizes every launch is of a specialisation compiled there. A specialisation first met at a launch (another
layout, e.g. per-token vectors at an unaligned offset under a caller's chunk size, or the logits path of
``vocab_parallel``, whose chunk is budgeted in fp32 anyway) is compiled right before it, and a failure there makes
:class:`ChunkMath` compute that chunk, and the rest of the call, on torch in the chunk the caller sized. An explicit
``"triton"``, or the environment variable ``NEMO_IS_STRICT_BACKEND=1`` (``STRICT_BACKEND_ENV``), makes any fallback
an error (:class:`BackendFallbackError`; a compile failure under ``"triton"`` raises TritonCompileError itself).

Which backend actually ran is recorded per pass: :func:`record_backends` collects it for a block of code (the
benchmark's ``backend`` column).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch

from nemo_is_plugin.common.once import warn_once
from nemo_is_plugin.kernels import triton_logprob as tk
from nemo_is_plugin.kernels.chunk_inplace import chunk_partials_, logits_grad_, softmax_grad_from_exp_
from nemo_is_plugin.kernels.softmax_partials import SoftmaxPartials, copy_partials_

BACKENDS = ("auto", "torch", "triton")
STRICT_BACKEND_ENV = "NEMO_IS_STRICT_BACKEND"  # "1": a fallback from Triton to torch under "auto" is an error
_triton_failure: str | None = None  # why "auto" fell back to torch in this process (torch from then on)
_backend_records: list[set[str]] = []  # the open record_backends() blocks


class BackendFallbackError(RuntimeError):
    """``auto`` would fall back from Triton to torch, and ``NEMO_IS_STRICT_BACKEND=1`` forbids it."""


def strict_backend() -> bool:
    """True when ``NEMO_IS_STRICT_BACKEND=1``: any fallback from Triton to torch raises."""
    value = os.environ.get(STRICT_BACKEND_ENV, "")
    if value not in ("", "0", "1"):
        raise ValueError(f"{STRICT_BACKEND_ENV} must be 1 (a fallback to torch is an error) or 0 / unset: {value!r}")
    return value == "1"


def triton_fallback_reason() -> str | None:
    """Why ``auto`` uses torch instead of Triton in this process (None: it has not fallen back)."""
    return _triton_failure


def _fall_back(reason: str) -> str:
    """Record the fallback of ``auto`` to torch (warned once) and return ``"torch"``; raise in strict mode."""
    global _triton_failure
    if strict_backend():
        raise BackendFallbackError(
            f"the Triton log-prob kernels cannot run ({reason}) and {STRICT_BACKEND_ENV}=1 forbids the fallback to "
            "the torch backend; fix the Triton install, or unset it to accept the (slower) torch backend"
        )
    _triton_failure = reason
    message = f"the Triton log-prob kernels cannot run ({reason}); the torch backend runs from now on (slower)"
    warn_once(message, message, RuntimeWarning)
    return "torch"


def resolve_backend(
    backend: str, device: torch.device, dtype: torch.dtype, *, cols: int | None = None, with_entropy: bool = False
) -> str:
    """``"torch"`` or ``"triton"`` for a chunk of ``dtype`` on ``device`` (see the module docstring).

    With ``cols`` (the chunk's columns) a Triton answer first compiles the kernels an LM-head call over such chunks
    launches (``triton_logprob.compile_kernels``): under ``auto`` a compile failure falls back here, before any chunk
    is sized or allocated; under ``triton`` it raises TritonCompileError."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "torch":
        return "torch"
    if backend == "triton":
        if not tk.triton_usable(device):
            raise ValueError("backend='triton' needs a CUDA device and an importable triton; use 'auto' or 'torch'")
        if dtype not in tk.TRITON_DTYPES:
            raise ValueError(f"backend='triton' takes {tk.TRITON_DTYPES} chunks, not {dtype}; use 'auto' or 'torch'")
        if cols is not None:
            tk.compile_kernels(dtype, cols, with_entropy)
        return "triton"
    if device.type != "cuda" or dtype not in tk.TRITON_DTYPES:
        return "torch"
    if _triton_failure is not None:
        return _fall_back(_triton_failure)
    if tk.triton is None:
        return _fall_back("triton is not importable")
    if cols is not None:
        try:
            tk.compile_kernels(dtype, cols, with_entropy)
        except tk.TritonCompileError as exc:
            return _fall_back(str(exc))
    return "triton"


@contextlib.contextmanager
def record_backends() -> Iterator[set[str]]:
    """The set of backends (``"torch"`` / ``"triton"``) the chunk passes ran on inside the block (filled as they
    run); empty when no chunk pass ran."""
    used: set[str] = set()
    _backend_records.append(used)
    try:
        yield used
    finally:
        _backend_records[:] = [r for r in _backend_records if r is not used]


def _ran(backend: str) -> None:
    for record in _backend_records:
        record.add(backend)


def grad_from_exp_(
    e: torch.Tensor,
    local_max: torch.Tensor,
    lse: torch.Tensor,
    local_target: torch.Tensor,
    owned: torch.Tensor,
    grad_logprob: torch.Tensor,
    out_scale: float,
) -> torch.Tensor:
    """Pass 2 of the torch single pass: ``softmax_grad_from_exp_`` on pass 1's ``e = exp(z - m)`` with the scale
    ``exp(m - lse)`` that turns it into ``p``."""
    return softmax_grad_from_exp_(e, torch.exp(local_max - lse), local_target, owned, grad_logprob, out_scale)


class ChunkMath:
    """Pass 1 and pass 2 of one forward or backward call, with the workspaces the torch backend needs.

    Args:
        backend: ``resolve_backend``'s answer; ``fallback`` allows switching from triton to torch on a failure.
        z_dtype: dtype of the chunks (the GEMM output); acc: dtype of the statistics and of the torch math.
        rows, cols: the largest chunk (``[rows, cols]``), for the torch backend's workspaces.
    """

    def __init__(
        self,
        backend: str,
        z_dtype: torch.dtype,
        acc: torch.dtype,
        device: torch.device,
        rows: int,
        cols: int,
        *,
        with_entropy: bool = False,
        fallback: bool = False,
        compile_torch: Callable[[Callable[..., Any]], Callable[..., Any]] | None = None,
    ):
        self.backend, self.fallback = backend, fallback
        # the torch backend's single-pass math, through a compiler when given (a compiled loss's: one or two kernels
        # a pass instead of 7-8 aten ops); the same functions either way
        compiled = compile_torch or (lambda fn: fn)
        self._partials_torch = compiled(chunk_partials_)
        self._grad_from_exp_torch = compiled(grad_from_exp_)
        self.z_dtype, self.acc, self.device = z_dtype, acc, device
        self.rows, self.cols, self.with_entropy = rows, cols, with_entropy
        self._work: torch.Tensor | None = None
        self._scratch: torch.Tensor | None = None
        self._exp: torch.Tensor | None = None  # torch single pass: exp(z - m) of the last chunk's pass 1

    # ------------------------------------------------------------------------------------------- workspaces
    @staticmethod
    def workspace_count(backend: str, z_dtype: torch.dtype, acc: torch.dtype, with_entropy: bool) -> int:
        """How many ``[rows, cols]`` buffers of ``acc`` the torch backend adds to the chunk itself (for budgets)."""
        if backend == "triton":
            return 0
        return int(z_dtype != acc) + int(with_entropy)

    def _workspace(self, n: int) -> torch.Tensor:
        if self._work is None:
            self._work = torch.empty(self.rows, self.cols, dtype=self.acc, device=self.device)
        return self._work[:n]

    def _scratch_buf(self) -> torch.Tensor:
        if self._scratch is None:
            self._scratch = torch.empty(self.rows, self.cols, dtype=self.acc, device=self.device)
        return self._scratch

    def _fp_view(self, z: torch.Tensor, in_scale: float, dest: torch.Tensor | None) -> torch.Tensor:
        """``z * in_scale`` in the accumulation dtype, in ``dest`` (which may be ``z``) when its dtype allows, else
        in the workspace."""
        if dest is not None and dest.dtype == self.acc:
            work = dest if dest.data_ptr() == z.data_ptr() else dest.copy_(z)
        else:
            work = self._workspace(z.shape[0]).copy_(z)
        return work if in_scale == 1.0 else work.mul_(in_scale)

    # ------------------------------------------------------------------------------------------- triton guard
    def _triton(self, fn, *args):
        """Run a Triton launcher. Only a compile failure before a specialisation's first launch may switch (under
        ``auto``, outside strict mode) to the torch backend, which then computes this chunk: returns None. Any other
        error propagates."""
        try:
            done = fn(*args)
        except tk.TritonCompileError as exc:
            if not self.fallback:
                raise
            self.backend = _fall_back(str(exc))
            return None
        _ran("triton")
        return done

    # ------------------------------------------------------------------------------------------- pass 1
    def partials(
        self,
        z: torch.Tensor,
        local_target: torch.Tensor,
        owned: torch.Tensor,
        target_column: torch.Tensor,
        in_scale: float,
        out: SoftmaxPartials | None = None,
        *,
        writable: bool = True,
    ) -> SoftmaxPartials:
        """Softmax partials ``[n]`` of ``z * in_scale``, written into ``out`` when given. With ``writable`` the
        torch backend computes in ``z`` when it is in the accumulation dtype (destroying it); else in a workspace."""
        if self.backend == "triton":
            if out is None:
                fields = torch.empty(4 if self.with_entropy else 3, z.shape[0], dtype=torch.float32, device=z.device)
                out = SoftmaxPartials(fields[0], fields[1], fields[2], fields[3] if self.with_entropy else None)
            done = self._triton(tk.triton_partials, z, target_column, in_scale, self.with_entropy, out)
            if done is not None:
                return done
        _ran("torch")
        work = self._fp_view(z, in_scale, z if writable else None)
        scratch = self._scratch_buf() if self.with_entropy else None
        got = self._partials_torch(work, local_target, owned, self.with_entropy, scratch)
        self._exp = None if self.with_entropy else work
        if out is None:
            return got
        return copy_partials_(out, got)

    # ------------------------------------------------------------------------------------------- pass 2
    def single_pass_grad(
        self,
        z: torch.Tensor,
        local: SoftmaxPartials,
        lse: torch.Tensor,
        local_target: torch.Tensor,
        owned: torch.Tensor,
        target_column: torch.Tensor,
        grad_logprob: torch.Tensor,
        in_scale: float,
        out_scale: float,
    ) -> torch.Tensor:
        """``out_scale g (onehot - p)`` in ``z``'s buffer (returned), right after :meth:`partials` of this chunk.

        ``local`` are this shard's partials (the torch backend turns ``exp(z - m)`` into ``p`` with
        ``exp(m - lse)``); ``lse`` the TP-global one."""
        if self.backend == "triton":
            done = self._triton(
                tk.triton_logits_grad, z, z, target_column, lse, grad_logprob, None, None, in_scale, out_scale
            )
            if done is not None:
                return done
        if self._exp is None:  # a triton pass 1 preceded this (fallback mid-chunk): recompute from the logits
            return self.logits_grad(
                z, z, local_target, owned, target_column, lse, grad_logprob, None, None, in_scale, out_scale
            )
        _ran("torch")
        e, self._exp = self._exp, None
        grad = self._grad_from_exp_torch(e, local.max, lse, local_target, owned, grad_logprob, out_scale)
        return grad if grad.data_ptr() == z.data_ptr() else z.copy_(grad)

    def logits_grad(
        self,
        z: torch.Tensor,
        out: torch.Tensor,
        local_target: torch.Tensor,
        owned: torch.Tensor,
        target_column: torch.Tensor,
        lse: torch.Tensor,
        grad_logprob: torch.Tensor | None,
        entropy: torch.Tensor | None,
        grad_entropy: torch.Tensor | None,
        in_scale: float,
        out_scale: float,
    ) -> torch.Tensor:
        """``out = out_scale (g (onehot - p) - h p (log p + H))`` from ``z`` and the global ``lse``; ``z`` is only
        written when ``out`` is ``z``."""
        if self.backend == "triton":
            done = self._triton(
                tk.triton_logits_grad,
                z,
                out,
                target_column,
                lse,
                grad_logprob,
                entropy,
                grad_entropy,
                in_scale,
                out_scale,
            )
            if done is not None:
                return done
        _ran("torch")
        work = self._fp_view(z, in_scale, out)
        use_h = grad_entropy is not None and entropy is not None
        grad = logits_grad_(
            work,
            local_target,
            owned,
            lse,
            grad_logprob,
            entropy,
            grad_entropy,
            self._scratch_buf() if use_h else None,
            out_scale,
        )
        return out if grad.data_ptr() == out.data_ptr() else out.copy_(grad)


__all__ = [
    "BACKENDS",
    "STRICT_BACKEND_ENV",
    "BackendFallbackError",
    "ChunkMath",
    "record_backends",
    "resolve_backend",
    "strict_backend",
    "triton_fallback_reason",
]
