"""The host heads on CUDA (``gpu`` tier; skipped without a device), one process:

- verl: the plugin's ``linear_cross_entropy`` against verl's own Triton kernel (``verl.utils.kernel.
  linear_cross_entropy``, H a multiple of 128 as it requires) and an fp64 reference, temperature 0.7. fp32 inputs:
  the plugin's log-probs, entropy, dX and dW within 1e-5 of fp64 (torch's fp32 GEMMs, no TF32), verl's within 1e-2
  (the same problem); bf16 inputs: the plugin equals the naive path on the same bf16 logits (log-probs and entropy 1e-5
  relative, gradients one bf16 rounding, 1e-2), and its log-prob error vs fp64 is no larger than verl's.
- NeMo-RL: the plugin's drop-in against the model of NeMo-RL's head (``tests/adapters/nemo_rl_head_host.py``) on CUDA:
  log-probs, dX and dW, fp32 to 1e-5, bf16 to 1e-2 (their chunk GEMMs differ in shape, so a bf16 logit may round
  differently).
"""

from __future__ import annotations

import pytest
import torch
from adapters import nemo_rl_head_host as host

from nemo_is_plugin.adapters.nemo_rl.head import from_parallel_hidden_states_to_logprobs
from nemo_is_plugin.adapters.verl.head import linear_cross_entropy

pytestmark = pytest.mark.gpu
N, H, V, T = 384, 256, 4096, 0.7


def _rel(a, b) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


def _problem(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=g) * 0.5
    weight = torch.randn(V, H, generator=g) * (3.0 / H**0.5)
    labels = torch.randint(0, V, (N,), generator=g)
    c_lp, c_h = torch.randn(N, generator=g), torch.randn(N, generator=g)
    cuda = [t.cuda() for t in (hidden.to(dtype), weight.to(dtype), labels, c_lp, c_h)]
    return cuda


def _fwd_bwd(fn, hidden, weight, labels, c_lp, c_h):
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    lp, ent = fn(h, w, labels)
    ((lp.float() * c_lp).sum() + (ent.float() * c_h).sum()).backward()
    return lp.detach(), ent.detach(), h.grad, w.grad


def _naive(h, w, labels, acc=torch.float32):
    logp = torch.log_softmax((h @ w.t()).to(acc) / T, dim=-1)
    return logp.gather(-1, labels[:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1)


def _verl(h, w, labels):
    from verl.utils.kernel.linear_cross_entropy import linear_cross_entropy as verl_kernel

    return verl_kernel(h, w, labels, T, "none", None)


def _plugin(h, w, labels):
    return linear_cross_entropy(h, w, labels, T, "none", None)


def test_verl_drop_in_fp32_against_fp64_and_verl_kernel():
    pytest.importorskip("verl.utils.kernel.linear_cross_entropy", reason="verl is the verl extra")
    inputs = _problem(torch.float32)
    ref = _fwd_bwd(lambda h, w, t: _naive(h.double(), w.double(), t, torch.float64), *inputs)
    got = _fwd_bwd(_plugin, *inputs)
    theirs = _fwd_bwd(_verl, *inputs)
    for g, v, r in zip(got, theirs, ref):
        assert _rel(g, r) < 1e-5
        assert _rel(v, r) < 1e-2  # verl's kernel ran on the same inputs and agrees to its own (TF32-level) accuracy


def test_verl_drop_in_bf16_equals_the_naive_path_and_is_no_less_accurate_than_verl():
    pytest.importorskip("verl.utils.kernel.linear_cross_entropy", reason="verl is the verl extra")
    inputs = _problem(torch.bfloat16)
    naive = _fwd_bwd(_naive, *inputs)
    got = _fwd_bwd(_plugin, *inputs)
    assert _rel(got[0], naive[0]) < 1e-5 and _rel(got[1], naive[1]) < 1e-5
    assert _rel(got[2], naive[2]) < 1e-2 and _rel(got[3], naive[3]) < 1e-2
    hidden, weight, labels = inputs[:3]
    exact = _naive(hidden.double(), weight.double(), labels, torch.float64)[0]
    with torch.no_grad():
        verl_lp = _verl(hidden, weight, labels)[0]
    assert _rel(got[0], exact) <= _rel(verl_lp, exact) * 1.1 + 1e-6


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_nemo_rl_drop_in_on_cuda_equals_nemo_rl_head(dtype, tol):
    g = torch.Generator().manual_seed(1)
    s, b = 64, 4
    hidden = torch.randn(s, b, H, generator=g).to("cuda", dtype)
    weight = (torch.randn(V, H, generator=g) * (3.0 / H**0.5)).to("cuda", dtype)
    labels = torch.randint(0, V, (b, s), generator=g).cuda()
    coef = torch.randn(b, s - 1, generator=g).cuda()
    out = []
    for fn, kw in (
        (host.from_parallel_hidden_states_to_logprobs, {"chunk_size": 16}),
        (from_parallel_hidden_states_to_logprobs, {}),
    ):
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        lp = fn(h, w, None, labels, 0, V, None, **kw)
        (lp.float() * coef).sum().backward()
        out.append((lp.detach(), h.grad, w.grad))
    for got, want in zip(out[1], out[0]):  # bf16: the two chunk GEMMs may round a logit differently (one ulp)
        assert _rel(got, want) < tol
