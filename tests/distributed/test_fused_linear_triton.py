"""The Triton kernels of the fused-linear path. No GPU here: the kernels run in Triton's interpreter
(``TRITON_INTERPRET=1``, numpy on CPU), which checks their indexing and math on tiny shapes but not GPU compilation
or speed; the ``gpu``-marked test compares them on a real device and skips without CUDA."""

from __future__ import annotations

import importlib

import pytest
import torch

from nemo_is_plugin.distributed.fused_linear import fused_linear_logprobs
from nemo_is_plugin.distributed.vocab_parallel import chunk_partials, localize_target, logits_grad

triton = pytest.importorskip("triton")
kernels_module = "nemo_is_plugin.kernels.triton_logprob"


@pytest.fixture(scope="module")
def interpreted():
    """The kernel module re-decorated under the interpreter (triton reads TRITON_INTERPRET at decoration)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("TRITON_INTERPRET", "1")
    module = importlib.reload(importlib.import_module(kernels_module))
    yield module
    mp.undo()
    importlib.reload(module)


def _data(n=37, h=40, v=70, seed=0):
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(n, h, generator=g), torch.randn(v, h, generator=g) * 0.5
    target = torch.randint(0, v + 20, (n,), generator=g)  # the shard is [10, 10 + v): some targets elsewhere
    return x, w, target


@pytest.mark.parametrize("with_entropy", [False, True])
def test_forward_kernel_partials_equal_chunk_partials(interpreted, with_entropy):
    x, w, target = _data()
    local_t, owned = localize_target(target, 10, 80)
    # ragged everything: 37 tokens / 16, 70 vocab / split 32 / block 16, H 40 / 16
    got = interpreted.fused_partials(x, w, local_t, owned, 0.8, with_entropy, block_n=16, block_v=16, block_k=16,
                                     split_v=32)
    want = chunk_partials((x @ w.t()) * 0.8, local_t, owned, with_entropy)
    for a, b in zip(got, want):
        if b is None:
            assert a is None
        else:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_backward_kernel_equals_logits_grad(interpreted):
    x, w, target = _data(seed=1)
    local_t, owned = localize_target(target, 10, 80)
    z = x @ w.t()
    g = torch.Generator().manual_seed(2)
    lse, ent = torch.logsumexp(z, -1), torch.rand(37, generator=g)
    g_lp, g_h = torch.randn(37, generator=g), torch.randn(37, generator=g)
    for args in ((g_lp, ent, g_h), (g_lp, None, None), (None, ent, g_h)):
        want = logits_grad(z.clone(), local_t, owned, lse, *args) * 0.8
        got = interpreted.logits_grad_triton_(z.clone(), local_t, owned, lse, *args, 0.8, block_v=32)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_fused_linear_with_triton_backend_matches_torch_backend(interpreted):
    x, w, _ = _data(n=24, h=32, v=48, seed=3)
    target = torch.randint(0, 48, (24,), generator=torch.Generator().manual_seed(4))
    coef = torch.randn(24, generator=torch.Generator().manual_seed(5))
    results = {}
    for backend in ("torch", "triton"):
        xb, wb = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        lp, ent = fused_linear_logprobs(xb, wb, target, chunk_size=10, temperature=0.9, with_entropy=True,
                                        backend=backend)
        ((lp * coef).sum() + ent.sum()).backward()
        results[backend] = (lp.detach(), ent.detach(), xb.grad, wb.grad)
    for a, b in zip(results["triton"], results["torch"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_triton_backend_is_refused_without_cuda_or_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    x, w, _ = _data(n=4, h=8, v=6)
    with pytest.raises(ValueError, match="CUDA"):
        fused_linear_logprobs(x, w, torch.zeros(4, dtype=torch.long), backend="triton")
    with pytest.raises(ValueError, match="backend"):
        fused_linear_logprobs(x, w, torch.zeros(4, dtype=torch.long), backend="cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_triton_matches_torch_on_gpu(dtype, tol):
    g = torch.Generator().manual_seed(6)
    x = torch.randn(300, 256, generator=g).to("cuda", dtype)
    w = (torch.randn(5000, 256, generator=g) / 16).to("cuda", dtype)
    target = torch.randint(0, 5000, (300,), generator=g).cuda()
    results = {}
    for backend in ("torch", "triton"):
        xb, wb = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        lp = fused_linear_logprobs(xb, wb, target, chunk_size=128, backend=backend)
        lp.sum().backward()
        results[backend] = (lp.detach().float(), xb.grad.float(), wb.grad.float())
    for a, b in zip(results["triton"], results["torch"]):
        assert ((a - b).abs().max() / b.abs().max()).item() < tol
