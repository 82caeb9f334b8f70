"""The Triton kernels of the fused-linear path. No GPU here: the kernels run in Triton's interpreter
(``TRITON_INTERPRET=1``, numpy on CPU), which checks their indexing and math on tiny shapes but not GPU compilation
or speed; the ``gpu``-marked test compares them on a real device and skips without CUDA."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
from pathlib import Path

import pytest
import torch

from nemo_is_plugin.distributed.fused_linear import fused_linear_logprobs
from nemo_is_plugin.distributed.vocab_parallel import chunk_partials, localize_target, logits_grad

triton = pytest.importorskip("triton")
TESTS_DIR = str(Path(__file__).resolve().parents[1])


def _data(n=37, h=40, v=70, seed=0):
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(n, h, generator=g), torch.randn(v, h, generator=g) * 0.5
    target = torch.randint(0, v + 20, (n,), generator=g)  # the shard is [10, 10 + v): some targets elsewhere
    return x, w, target


# ------------------------------------------------------------- checks run in a child process under the interpreter
def check_forward_partials() -> None:
    from nemo_is_plugin.kernels.triton_logprob import fused_partials

    x, w, target = _data()
    local_t, owned = localize_target(target, 10, 80)
    for with_entropy in (False, True):
        # ragged everything: 37 tokens / 16, 70 vocab / split 32 / block 16, H 40 / 16
        got = fused_partials(x, w, local_t, owned, 0.8, with_entropy, block_n=16, block_v=16, block_k=16, split_v=32)
        want = chunk_partials((x @ w.t()) * 0.8, local_t, owned, with_entropy)
        for a, b in zip(got, want):
            assert (a is None) == (b is None)
            if b is not None:
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def check_backward_logits_grad() -> None:
    from nemo_is_plugin.kernels.triton_logprob import logits_grad_triton_

    x, w, target = _data(seed=1)
    local_t, owned = localize_target(target, 10, 80)
    z = x @ w.t()
    g = torch.Generator().manual_seed(2)
    lse, ent = torch.logsumexp(z, -1), torch.rand(37, generator=g)
    g_lp, g_h = torch.randn(37, generator=g), torch.randn(37, generator=g)
    for args in ((g_lp, ent, g_h), (g_lp, None, None), (None, ent, g_h)):
        want = logits_grad(z.clone(), local_t, owned, lse, *args) * 0.8
        got = logits_grad_triton_(z.clone(), local_t, owned, lse, *args, 0.8, block_v=32)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def check_fused_linear_backends_agree() -> None:
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


INTERPRETER_CHECKS = {
    "forward_partials": check_forward_partials,
    "backward_logits_grad": check_backward_logits_grad,
    "fused_linear_backends_agree": check_fused_linear_backends_agree,
}


def run_interpreter_checks(out_path: str) -> None:
    """Child-process entry: every check, its traceback or None, as JSON."""
    results = {}
    for name, fn in INTERPRETER_CHECKS.items():
        try:
            fn()
            results[name] = None
        except Exception:
            results[name] = traceback.format_exc()
    Path(out_path).write_text(json.dumps(results))


@pytest.fixture(scope="module")
def interpreter_results(tmp_path_factory):
    """Triton reads TRITON_INTERPRET when it is first imported, so the checks run in a fresh interpreter process."""
    out = tmp_path_factory.mktemp("triton") / "results.json"
    code = (f"import sys; sys.path.insert(0, {TESTS_DIR!r}); from {__name__} import run_interpreter_checks; "
            f"run_interpreter_checks({str(out)!r})")
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=600)
    return json.loads(out.read_text())


@pytest.mark.parametrize("name", list(INTERPRETER_CHECKS))
def test_kernel_under_triton_interpreter(interpreter_results, name):
    assert interpreter_results[name] is None, interpreter_results[name]


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
