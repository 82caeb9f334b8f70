"""kernels/chunk_math.py: which backend runs where, and the torch backend on low-precision chunks (what a GPU without
triton runs), against float64 references. The fallback from Triton to torch: test_backend_fallback.py.

Tolerances: statistics 1e-6 relative (fp32 math on exact bf16 values); a gradient written back into a bf16 chunk is one
bf16 rounding (2^-8) of the largest entry.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from nemo_is_plugin.common import once
from nemo_is_plugin.kernels import chunk_math
from nemo_is_plugin.kernels import triton_logprob as tk
from nemo_is_plugin.kernels.chunk_math import ChunkMath, resolve_backend

N, V, SCALE = 6, 29, 0.8
CUDA = torch.device("cuda")  # a device object only: nothing is allocated on it


def _case(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    z = (torch.randn(N, V, generator=g) * 3).to(dtype)
    column = torch.tensor([0, V - 1, -1, 4, -1, 11])
    zz = z.double() * SCALE
    return z, column.clamp_min(0), column >= 0, column, zz, torch.randn(N, generator=g)


def _reference_grad(zz, column, lse, g):
    p = torch.exp(zz - lse[:, None])
    onehot = torch.zeros_like(zz)
    for i, col in enumerate(column.tolist()):
        if col >= 0:
            onehot[i, col] = 1.0
    return SCALE * g.double()[:, None] * (onehot - p)


def test_resolve_backend_rules(monkeypatch):
    monkeypatch.setattr(chunk_math, "_triton_failure", None)
    cpu = torch.device("cpu")
    assert resolve_backend("auto", cpu, torch.bfloat16) == "torch"
    assert resolve_backend("torch", CUDA, torch.bfloat16) == "torch"
    assert resolve_backend("auto", CUDA, torch.float64) == "torch"  # fp64 stays on torch
    if tk.triton is not None:
        assert resolve_backend("auto", CUDA, torch.bfloat16) == "triton"  # a CUDA user gets Triton without a flag
    with pytest.raises(ValueError, match="backend must be one of"):
        resolve_backend("cuda", cpu, torch.float32)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="CUDA"):
        resolve_backend("triton", cpu, torch.float32)


def test_missing_triton_on_cuda_warns_once_and_uses_torch(monkeypatch):
    monkeypatch.setattr(chunk_math, "_triton_failure", None)
    monkeypatch.setattr(tk, "triton", None)
    monkeypatch.setattr(once, "_WARNED", set())
    with pytest.warns(RuntimeWarning, match="triton is not importable"):
        assert resolve_backend("auto", CUDA, torch.bfloat16) == "torch"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert resolve_backend("auto", CUDA, torch.bfloat16) == "torch"  # warned once only


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_torch_backend_on_low_precision_chunks(dtype):
    """A bf16 / fp16 chunk (a GPU without triton): the torch backend computes in an fp32 workspace and writes the
    gradient back into the chunk's buffer; pass 1 leaves the chunk itself untouched."""
    z, local_t, owned, column, zz, g = _case(dtype, seed=1)
    lse = (torch.logsumexp(zz, -1) + 0.2).float()  # a TP-global lse above this shard's
    math = ChunkMath("torch", dtype, torch.float32, z.device, N + 2, V)
    buf = z.clone()
    parts = math.partials(buf, local_t, owned, column, SCALE)
    assert torch.equal(buf, z)
    m = zz.amax(-1)
    torch.testing.assert_close(parts.max.double(), m, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(parts.sumexp.double(), torch.exp(zz - m[:, None]).sum(-1), rtol=1e-6, atol=1e-6)
    dz = math.single_pass_grad(buf, parts, lse, local_t, owned, column, g, SCALE, SCALE)
    want = _reference_grad(zz, column, lse.double(), g)
    assert dz.data_ptr() == buf.data_ptr() and dz.dtype == dtype
    assert (dz.double() - want).abs().max() <= 2.0**-8 * want.abs().max()
    out = torch.empty_like(z)
    two_pass = math.logits_grad(z, out, local_t, owned, column, lse, g, None, None, SCALE, SCALE)
    assert two_pass.data_ptr() == out.data_ptr()
    assert (two_pass.double() - want).abs().max() <= 2.0**-8 * want.abs().max()
