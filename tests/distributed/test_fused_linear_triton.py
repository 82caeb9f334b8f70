"""The fused-linear entry points on the Triton backend. No GPU here: the kernels run in Triton's interpreter
(``TRITON_INTERPRET=1``, numpy on CPU, tiny shapes), which checks the chunk loops and kernels end to end (two-pass
log-probs with entropy and temperature, the single-pass loss, TP-style unowned targets) but neither GPU compilation
(tests/kernels/test_triton_compile.py) nor speed. The ``gpu``-marked tests run the same comparisons on a CUDA device
in fp32 and bf16 and skip without one. Kernel-level parity: tests/kernels/test_triton_chunk_kernels.py.
"""

from __future__ import annotations

import pytest
import torch
from kernels._interpreter import interpreter_results

from nemo_is_plugin.distributed.head.fused_linear import fused_linear_logprobs

from ._fused_cases import TIGHT_TIS
from ._triton_backends import assert_pg_loss_backends_agree, run_keeping_blocks, small_blocks

triton = pytest.importorskip("triton")


def _data(n=24, h=32, v=48, seed=3, device="cpu", dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(n, h, generator=g), torch.randn(v, h, generator=g) * 0.3
    target = torch.randint(0, v, (n,), generator=g)
    return x.to(device, dtype), w.to(device, dtype), target.to(device)


def _logprob_run(backend, x, w, target, coef, **kwargs):
    xb, wb = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    lp, ent = fused_linear_logprobs(
        xb, wb, target, chunk_size=10, temperature=0.9, with_entropy=True, backend=backend, **kwargs
    )
    ((lp * coef).sum() + ent.sum()).backward()
    return lp.detach(), ent.detach(), xb.grad, wb.grad


def check_fused_linear_backends_agree(device="cpu", dtype=torch.float32, tol=1e-5):
    """Two-pass log-probs + entropy with temperature: triton equals torch and the float64 naive reference."""
    small_blocks()
    x, w, target = _data(device=device, dtype=dtype)
    coef = torch.randn(target.shape, generator=torch.Generator().manual_seed(5)).to(device)
    got = _logprob_run("triton", x, w, target, coef)
    ref = _logprob_run("torch", x, w, target, coef)
    xr, wr = x.double().requires_grad_(True), w.double().requires_grad_(True)
    logp = torch.log_softmax(xr @ wr.t() / 0.9, -1)
    lp, ent = logp.gather(1, target[:, None]).squeeze(1), -(logp.exp() * logp).sum(-1)
    ((lp * coef.double()).sum() + ent.sum()).backward()
    for a, b, c in zip(got, ref, (lp.detach(), ent.detach(), xr.grad, wr.grad)):
        assert ((a.double() - c).abs().max() / c.abs().max()).item() < tol
        assert ((a.double() - b.double()).abs().max() / c.abs().max()).item() < tol


def check_pg_loss_single_and_two_pass(device="cpu", dtype=torch.float32, tol=1e-5):
    """fused_linear_pg_loss on the triton backend (single pass with TIS + k3 KL, and forced two-pass) equals the torch
    backend: loss, metrics and gradients."""
    from nemo_is_plugin.apps.bench.problem import make_problem

    config = dict(ratio_level="token", is_correction_level="token", **TIGHT_TIS, reference_policy_kl_penalty=0.1)
    assert_pg_loss_backends_agree(make_problem(3, 9, 16, 37, seed=0), config, device, dtype, tol, metric_atol=1e-7)


INTERPRETER_CHECKS = {
    "fused_linear_backends_agree": check_fused_linear_backends_agree,
    "pg_loss_single_and_two_pass": check_pg_loss_single_and_two_pass,
}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return interpreter_results(__name__, tmp_path_factory.mktemp("triton_fused"))


@pytest.mark.parametrize("name", list(INTERPRETER_CHECKS))
def test_fused_linear_under_triton_interpreter(results, name):
    assert results[name] is None, results[name]


def test_triton_backend_is_refused_without_cuda_or_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    x, w, _ = _data(n=4, h=8, v=6)
    with pytest.raises(ValueError, match="CUDA"):
        fused_linear_logprobs(x, w, torch.zeros(4, dtype=torch.long), backend="triton")
    with pytest.raises(ValueError, match="backend"):
        fused_linear_logprobs(x, w, torch.zeros(4, dtype=torch.long), backend="cuda")


# ------------------------------------------------------------------------------------------------------ GPU tier


@pytest.mark.parametrize("check", [check_fused_linear_backends_agree, check_pg_loss_single_and_two_pass])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_triton_matches_torch_and_reference_on_gpu(check, dtype, tol):
    """fp32: TF32 is off by default for matmuls, so 1e-5 holds; bf16: inputs, logits and dz are bf16 (a few bf16
    roundings of 2^-8 relative each reach the gradients), 3e-2 of the largest entry."""
    run_keeping_blocks(check, device="cuda", dtype=dtype, tol=tol)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_default_backend_on_gpu_matches_torch(dtype, tol):
    """A CUDA user gets the Triton backend without a flag (``auto``), with the default block sizes and chunking."""
    g = torch.Generator().manual_seed(6)
    x = torch.randn(300, 256, generator=g).to("cuda", dtype)
    w = (torch.randn(5000, 256, generator=g) / 16).to("cuda", dtype)
    target = torch.randint(0, 5000, (300,), generator=g).cuda()
    results = {}
    for backend in ("torch", "auto"):
        xb, wb = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        lp = fused_linear_logprobs(xb, wb, target, chunk_size=128, backend=backend)
        lp.sum().backward()
        results[backend] = (lp.detach().float(), xb.grad.float(), wb.grad.float())
    for a, b in zip(results["auto"], results["torch"]):
        assert ((a - b).abs().max() / b.abs().max()).item() < tol
