"""Score centering's head on the Triton backend. No GPU here: the kernels run in Triton's interpreter
(``TRITON_INTERPRET=1``, numpy on CPU, tiny shapes; tests/kernels/_interpreter.py): the head's gather before pass 1
and its scatter-adds after pass 2 around the Triton kernels give the torch backend's and the float64 reference's
log-probs and gradients (two pass with entropy and temperature; the fused loss with score centering in one and two
passes), and a head slot holding the label equals the label's log-prob bit for bit (same lse, same gathered logit).
The ``gpu``-marked test runs the same checks on a CUDA device in fp32 and bf16 and skips without one."""

from __future__ import annotations

import pytest
import torch
from kernels._interpreter import interpreter_results

from ._triton_backends import assert_pg_loss_backends_agree, run_keeping_blocks, small_blocks

triton = pytest.importorskip("triton")


def check_head_backends_agree(device="cpu", dtype=torch.float32, tol=1e-5):
    from helpers.head_reference import head_ids_with_padding, head_loss, head_reference

    from nemo_is_plugin.distributed.head.fused_linear import fused_linear_logprobs

    small_blocks()
    g = torch.Generator().manual_seed(3)
    n, hid, v, k = 24, 32, 48, 5
    x, w = torch.randn(n, hid, generator=g), torch.randn(v, hid, generator=g) * 0.3
    target = torch.randint(0, v, (n,), generator=g)
    ids = head_ids_with_padding((n,), k, v, 4)
    ids[5, 2] = target[5]
    c_label, c_head = torch.randn(n, generator=g), torch.randn(n, k, generator=g)
    out = {}
    for backend in ("torch", "triton"):
        xb = x.to(device, dtype).clone().requires_grad_(True)
        wb = w.to(device, dtype).clone().requires_grad_(True)
        lp, ent, head = fused_linear_logprobs(
            xb,
            wb,
            target.to(device),
            chunk_size=10,
            temperature=0.9,
            with_entropy=True,
            backend=backend,
            head_ids=ids.to(device),
        )
        (head_loss(lp, head, c_label.to(device), c_head.to(device)) + ent.sum()).backward()
        out[backend] = [t.detach().double().cpu() for t in (lp, head, xb.grad, wb.grad)]
        if dtype == torch.float32:
            assert head[5, 2] == lp[5]  # the label's slot: the same logit over the same lse
    xr, wr = x.to(dtype).double().requires_grad_(True), w.to(dtype).double().requires_grad_(True)
    logits = xr @ wr.t() / 0.9
    label, head = head_reference(logits, target, ids)
    logp = torch.log_softmax(logits, -1)
    (head_loss(label, head, c_label.double(), c_head.double()) - (logp.exp() * logp).sum()).backward()
    want = [label.detach(), head.detach(), xr.grad, wr.grad]
    finite = torch.isfinite(want[1])
    for got in (out["triton"], out["torch"]):
        assert torch.equal(torch.isfinite(got[1]), finite)
        got[1], want_head = got[1][finite], want[1][finite]
        for a, b in zip(got, [want[0], want_head, want[2], want[3]]):
            assert ((a - b).abs().max() / b.abs().max()).item() < tol


def check_centering_loss_backends_agree(device="cpu", dtype=torch.float32, tol=1e-5):
    """fused_linear_pg_loss with score centering on the triton backend, single and two pass, equals the torch
    backend: loss, metrics and gradients."""
    from ._centering_cases import CONFIGS, centering_problem

    assert_pg_loss_backends_agree(centering_problem(), CONFIGS["tis"], device, dtype, tol, metric_atol=1e-6)


INTERPRETER_CHECKS = {
    "head_backends_agree": check_head_backends_agree,
    "centering_loss_backends_agree": check_centering_loss_backends_agree,
}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return interpreter_results(__name__, tmp_path_factory.mktemp("triton_head"))


@pytest.mark.parametrize("name", list(INTERPRETER_CHECKS))
def test_head_under_triton_interpreter(results, name):
    assert results[name] is None, results[name]


@pytest.mark.parametrize("check", [check_head_backends_agree, check_centering_loss_backends_agree])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_head_triton_matches_torch_and_reference_on_gpu(check, dtype, tol):
    """fp32: 1e-5; bf16: inputs, logits and dz are bf16, and the head's scatter-adds round dz once more (3e-2 of the
    largest entry)."""
    run_keeping_blocks(check, device="cuda", dtype=dtype, tol=tol)
