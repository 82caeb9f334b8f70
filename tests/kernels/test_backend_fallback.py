"""No silent fallback from the Triton backend to torch (kernels/chunk_math.py, kernels/triton_logprob.py,
kernels/chunking.py).

- a compile failure before a specialisation's first launch falls back under ``auto``: one warning, this chunk computed
  by the torch backend (same values as the torch backend itself), ``record_backends`` says "torch", the process stays
  on torch; when it happens while an LM-head call plans its chunks, the chunk is sized for the torch backend's fp32
  workspace (at most ``GPU_CHUNK_BYTES`` with it);
- an error of a launch (first or later) and a caller's bad argument propagate, and switch nothing;
- ``backend="triton"`` and ``NEMO_IS_STRICT_BACKEND=1`` make any fallback an error;
- each specialisation is compiled once per process, before its first launch.

Failures are simulated by monkeypatching ``triton_logprob._compile`` (the compile step) and ``triton_logprob._run``
(the launch); no Triton kernel is compiled or run here. CUDA is a device object only (nothing is allocated on it).
"""

from __future__ import annotations

import warnings

import pytest
import torch

from nemo_is_plugin.common import once
from nemo_is_plugin.kernels import chunk_math
from nemo_is_plugin.kernels import triton_logprob as tk
from nemo_is_plugin.kernels.chunk_math import BackendFallbackError, ChunkMath, record_backends, resolve_backend
from nemo_is_plugin.kernels.chunking import GPU_CHUNK_BYTES, plan_chunks

N, V, SCALE = 6, 29, 0.8
CUDA = torch.device("cuda")
QWEN_VOCAB = 151936
needs_triton = pytest.mark.skipif(tk.triton is None, reason="triton is not importable")


@pytest.fixture(autouse=True)
def fresh_process_state(monkeypatch):
    """Each test starts as a fresh process: nothing compiled, no fallback recorded, nothing warned, not strict."""
    monkeypatch.setattr(tk, "_COMPILED", set())
    monkeypatch.setattr(chunk_math, "_triton_failure", None)
    monkeypatch.setattr(once, "_WARNED", set())
    monkeypatch.delenv(chunk_math.STRICT_BACKEND_ENV, raising=False)


def _case(seed=0):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(N, V, generator=g) * 3
    column = torch.tensor([0, V - 1, -1, 4, -1, 11])
    return z, column.clamp_min(0), column >= 0, column, torch.randn(N, generator=g)


def _compile_fails(monkeypatch, calls=None):
    def broken(kernel, grid, args, kwargs):
        if calls is not None:
            calls.append(kernel)
        raise RuntimeError("PTX assembly failed: ptxas fatal")

    monkeypatch.setattr(tk, "_compile", broken)


def _compile_ok(monkeypatch, calls):
    monkeypatch.setattr(tk, "_compile", lambda kernel, grid, args, kwargs: calls.append(kernel))


@needs_triton
def test_compile_failure_at_first_launch_falls_back_reports_torch_and_matches_torch(monkeypatch):
    _compile_fails(monkeypatch)
    z, local_t, owned, column, g = _case()
    want = ChunkMath("torch", torch.float32, torch.float32, z.device, N, V).partials(
        z.clone(), local_t, owned, column, SCALE
    )
    math = ChunkMath("triton", torch.float32, torch.float32, z.device, N, V, fallback=True)
    with record_backends() as used, pytest.warns(RuntimeWarning, match="PTX assembly failed"):
        got = math.partials(z.clone(), local_t, owned, column, SCALE)
    assert used == {"torch"} and math.backend == "torch"
    for a, b in zip(got, want):
        assert (a is None) == (b is None) and (a is None or torch.equal(a, b))
    reason = chunk_math.triton_fallback_reason()
    assert reason is not None and "_partials_kernel failed to compile: RuntimeError: PTX assembly failed" in reason
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once per process
        assert resolve_backend("auto", CUDA, torch.bfloat16) == "torch"  # the process stays on torch
    # pass 2 after a fallen-back pass 1: the torch single pass, against float64
    lse = torch.logsumexp(z.double() * SCALE, -1)
    dz = math.single_pass_grad(z.clone(), got, lse.float(), local_t, owned, column, g, SCALE, SCALE)
    p = torch.softmax(z.double() * SCALE, -1)
    onehot = torch.zeros(N, V, dtype=torch.float64)
    onehot[owned, local_t[owned]] = 1.0
    torch.testing.assert_close(dz.double(), SCALE * g.double()[:, None] * (onehot - p), rtol=1e-5, atol=1e-6)


@needs_triton
@pytest.mark.parametrize("with_entropy", [False, True])
def test_fallback_while_planning_sizes_the_chunk_for_the_torch_workspace(monkeypatch, with_entropy):
    """An LM-head call compiles its kernels before it sizes its chunk: Triton's chunk is the bf16 logits alone; after
    a compile failure the chunk holds the bf16 logits plus the torch backend's fp32 workspace(s) within the budget."""
    calls: list = []
    _compile_ok(monkeypatch, calls)
    backend, triton_rows = plan_chunks("auto", CUDA, torch.bfloat16, QWEN_VOCAB, None, with_entropy)
    assert backend == "triton" and triton_rows * QWEN_VOCAB * 2 <= GPU_CHUNK_BYTES
    assert len(calls) == (4 if with_entropy else 2)  # pass 1, and pass 2 for each upstream gradient it can get

    monkeypatch.setattr(tk, "_COMPILED", set())
    _compile_fails(monkeypatch)
    with pytest.warns(RuntimeWarning, match="failed to compile"):
        backend, rows = plan_chunks("auto", CUDA, torch.bfloat16, QWEN_VOCAB, None, with_entropy)
    workspaces = ChunkMath.workspace_count("torch", torch.bfloat16, torch.float32, with_entropy)
    assert backend == "torch" and workspaces == 1 + int(with_entropy)
    assert rows * QWEN_VOCAB * (2 + 4 * workspaces) <= GPU_CHUNK_BYTES < triton_rows * QWEN_VOCAB * (2 + 4 * workspaces)
    # a caller's chunk size is kept whatever the backend
    assert plan_chunks("auto", CUDA, torch.bfloat16, QWEN_VOCAB, 100, with_entropy) == ("torch", 100)


@needs_triton
def test_launch_errors_propagate_on_the_first_and_later_launches(monkeypatch):
    calls: list = []
    _compile_ok(monkeypatch, calls)
    launches: list = []

    def run(kernel, grid, args, kwargs):
        launches.append(kernel)
        if len(launches) in (1, 3):  # the first launch fails, the second works, the third fails
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(tk, "_run", run)
    z, local_t, owned, column, _ = _case()
    math = ChunkMath("triton", torch.float32, torch.float32, z.device, N, V, fallback=True)
    with warnings.catch_warnings(), record_backends() as used:
        warnings.simplefilter("error")  # no fallback warning either
        with pytest.raises(RuntimeError, match="illegal memory access"):
            math.partials(z.clone(), local_t, owned, column, SCALE)
        math.partials(z.clone(), local_t, owned, column, SCALE)
        with pytest.raises(RuntimeError, match="illegal memory access"):
            math.partials(z.clone(), local_t, owned, column, SCALE)
    assert len(launches) == 3 and len(calls) == 1  # compiled once, before the first launch
    assert used == {"triton"}
    assert math.backend == "triton" and chunk_math.triton_fallback_reason() is None
    # a caller's argument is not a kernel failure either
    with pytest.raises(tk.ChunkLayoutError):
        math.partials(z.double(), local_t, owned, column, SCALE)
    assert math.backend == "triton"


@needs_triton
def test_explicit_triton_raises_on_a_compile_failure(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # makes backend="triton" usable on this CPU
    _compile_fails(monkeypatch)
    z, local_t, owned, column, _ = _case()
    strict = ChunkMath("triton", torch.float32, torch.float32, z.device, N, V, fallback=False)
    with pytest.raises(tk.TritonCompileError, match="PTX assembly failed"):
        strict.partials(z.clone(), local_t, owned, column, SCALE)
    with pytest.raises(tk.TritonCompileError, match="PTX assembly failed"):
        plan_chunks("triton", CUDA, torch.bfloat16, QWEN_VOCAB, None)
    assert strict.backend == "triton" and chunk_math.triton_fallback_reason() is None


@needs_triton
def test_the_strict_switch_makes_every_fallback_of_auto_an_error(monkeypatch):
    monkeypatch.setenv(chunk_math.STRICT_BACKEND_ENV, "1")
    _compile_fails(monkeypatch)
    z, local_t, owned, column, _ = _case()
    math = ChunkMath("triton", torch.float32, torch.float32, z.device, N, V, fallback=True)
    with pytest.raises(BackendFallbackError, match="NEMO_IS_STRICT_BACKEND=1 forbids"):
        math.partials(z.clone(), local_t, owned, column, SCALE)
    with pytest.raises(BackendFallbackError, match="failed to compile"):
        plan_chunks("auto", CUDA, torch.bfloat16, QWEN_VOCAB, None)
    monkeypatch.setattr(tk, "triton", None)
    with pytest.raises(BackendFallbackError, match="triton is not importable"):
        resolve_backend("auto", CUDA, torch.bfloat16)
    assert chunk_math.triton_fallback_reason() is None
    assert resolve_backend("auto", torch.device("cpu"), torch.float32) == "torch"  # CPU: torch is no fallback
    monkeypatch.setenv(chunk_math.STRICT_BACKEND_ENV, "yes")
    with pytest.raises(ValueError, match="NEMO_IS_STRICT_BACKEND must be 1"):
        resolve_backend("auto", CUDA, torch.bfloat16)


class _FakeKernel:
    """Stands in for a JIT function: ``warmup`` records what it compiled and returns a loadable binary."""

    __name__ = "_fake_kernel"

    def __init__(self, load_error: Exception | None = None):
        self.compiled: list = []
        self.load_error = load_error

    def warmup(self, *args, grid, **kwargs):
        self.compiled.append(args)
        return self

    def _init_handles(self):
        if self.load_error is not None:
            raise self.load_error


def test_each_specialisation_is_compiled_once_before_its_first_launch():
    kernel = _FakeKernel()
    z = torch.zeros(64)
    tk._ensure_compiled(kernel, (1,), (z, 32, 1.0), {"BLOCK_V": 16})
    tk._ensure_compiled(kernel, (1,), (z, 32, 2.0), {"BLOCK_V": 16})  # another float: the same binary
    assert len(kernel.compiled) == 1
    tk._ensure_compiled(kernel, (1,), (z[1:], 32, 1.0), {"BLOCK_V": 16})  # 4-byte offset: not 16-byte aligned
    tk._ensure_compiled(kernel, (1,), (z, 33, 1.0), {"BLOCK_V": 16})  # an integer not divisible by 16
    tk._ensure_compiled(kernel, (1,), (z.double(), 32, 1.0), {"BLOCK_V": 16})
    tk._ensure_compiled(kernel, (1,), (z, 32, 1.0), {"BLOCK_V": 32})
    assert len(kernel.compiled) == 5
    refused = _FakeKernel(load_error=RuntimeError("out of resource: shared memory, Required: 300000"))
    with pytest.raises(tk.TritonCompileError, match="_fake_kernel failed to compile: RuntimeError: out of resource"):
        tk._ensure_compiled(refused, (1,), (z, 32, 1.0), {})
