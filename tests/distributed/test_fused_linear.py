"""Single-process checks of the fused hidden-states -> log-prob op against a naive full-logits log_softmax."""

from __future__ import annotations

import pytest
import torch

from nemo_is_plugin.apps.bench.memory import TensorMemoryTracker
from nemo_is_plugin.distributed.head.fused_linear import fused_linear_logprobs


def _inputs(n=(3, 7), hidden=16, vocab=37, seed=0, dtype=torch.float32, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(*n, hidden, generator=g, dtype=torch.float64) * scale).to(dtype)
    w = (torch.randn(vocab, hidden, generator=g, dtype=torch.float64) / hidden**0.5 * 3).to(dtype)
    target = torch.randint(0, vocab, n, generator=g)
    return x, w, target


def _naive(x, w, target, temperature=1.0):
    """Full logits -> log_softmax -> gather, in x's dtype (the reference; float64 for ground truth)."""
    logp = torch.log_softmax((x @ w.t()) / temperature, dim=-1)
    lp = logp.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    return lp, -(logp.exp() * logp).sum(-1)


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


@pytest.mark.parametrize("with_entropy", [False, True])
def test_gradcheck_float64(with_entropy):
    x, w, target = _inputs(n=(2, 5), hidden=6, vocab=11, dtype=torch.float64)
    x.requires_grad_(True)
    w.requires_grad_(True)

    def fn(x_, w_):
        return fused_linear_logprobs(x_, w_, target, chunk_size=3, temperature=0.7, with_entropy=with_entropy)

    assert torch.autograd.gradcheck(fn, (x, w))


@pytest.mark.parametrize("chunk_size", [1, 4, 7, 100])
def test_fp32_values_and_gradients_match_naive_within_1e5(chunk_size):
    x, w, target = _inputs(seed=1)
    g = torch.Generator().manual_seed(2)
    c_lp, c_h = torch.randn(target.shape, generator=g), torch.randn(target.shape, generator=g)

    xf, wf = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    lp, ent = fused_linear_logprobs(xf, wf, target, chunk_size=chunk_size, with_entropy=True)
    ((lp * c_lp).sum() + (ent * c_h).sum()).backward()

    xr, wr = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    ref_lp, ref_h = _naive(xr, wr, target)
    ((ref_lp * c_lp).sum() + (ref_h * c_h).sum()).backward()

    assert lp.dtype == torch.float32 and lp.shape == target.shape
    assert (lp <= 0).all()  # verl #2656: fused log-probs > 0 collapsed a run
    for got, want in ((lp, ref_lp), (ent, ref_h), (xf.grad, xr.grad), (wf.grad, wr.grad)):
        assert _rel_err(got, want) < 1e-5


def test_temperature_divides_the_logits():
    x, w, target = _inputs(seed=3)
    lp = fused_linear_logprobs(x, w, target, chunk_size=5, temperature=0.6)
    ref, _ = _naive(x.double(), w.double(), target, temperature=0.6)
    torch.testing.assert_close(lp.double(), ref, rtol=1e-6, atol=1e-6)


def test_bf16_inputs_fp32_logprobs_bf16_grads():
    """bf16 hidden/weight: computed in fp32 on the exact bf16 values; tolerance 1e-5 on log-probs against an fp32
    reference on the same values, and 1e-2 relative on the bf16 gradients (one bf16 rounding, 2^-8, of each entry)."""
    x, w, target = _inputs(seed=4, dtype=torch.bfloat16)
    xf, wf = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    lp = fused_linear_logprobs(xf, wf, target, chunk_size=4)
    lp.sum().backward()
    x32, w32 = x.float().requires_grad_(True), w.float().requires_grad_(True)
    ref, _ = _naive(x32, w32, target)
    ref.sum().backward()
    assert lp.dtype == torch.float32 and xf.grad.dtype == torch.bfloat16 and wf.grad.dtype == torch.bfloat16
    assert _rel_err(lp, ref) < 1e-5
    assert _rel_err(xf.grad, x32.grad) < 1e-2 and _rel_err(wf.grad, w32.grad) < 1e-2


def test_frozen_weight_gets_no_gradient_and_hidden_grad_is_right():
    x, w, target = _inputs(seed=5)
    xf = x.clone().requires_grad_(True)
    fused_linear_logprobs(xf, w, target, chunk_size=3).sum().backward()
    xr = x.clone().requires_grad_(True)
    _naive(xr, w, target)[0].sum().backward()
    assert w.grad is None
    assert _rel_err(xf.grad, xr.grad) < 1e-5


def test_out_of_range_target_gives_minus_lse():
    x, w, _ = _inputs(n=(2,), seed=6)
    lp = fused_linear_logprobs(x, w, torch.tensor([-100, 37]))
    torch.testing.assert_close(lp.double(), -torch.logsumexp(x.double() @ w.double().t(), -1), rtol=1e-6, atol=1e-6)


def test_extra_memory_is_one_chunk_not_tokens_by_vocab():
    """Forward: lse [N] + one [chunk, V] workspace; forward+backward adds the gradients, never [N, V]."""
    hidden, vocab, chunk = 8, 2000, 16
    peaks = {}
    for n in (64, 256):
        x, w, target = _inputs(n=(n,), hidden=hidden, vocab=vocab, seed=8)
        x.requires_grad_(True)
        w.requires_grad_(True)
        with TensorMemoryTracker() as mem:
            lp = fused_linear_logprobs(x, w, target, chunk_size=chunk)
            fwd_peak = mem.peak
            lp.sum().backward()
        peaks[n] = (fwd_peak, mem.peak)
    chunk_bytes = chunk * vocab * 4
    for n, (fwd_peak, total_peak) in peaks.items():
        assert chunk_bytes <= fwd_peak < chunk_bytes + 64 * n  # workspace + a few [N] vectors
        grads = (n * hidden + vocab * hidden) * 4
        assert total_peak < chunk_bytes + grads + 64 * n
    assert peaks[256][0] - peaks[64][0] < 64 * 192  # growth with N is O(N) bytes, not O(N V) = 1.5 MB here


def test_empty_batch():
    x, w, _ = _inputs(n=(0,), seed=9)
    x.requires_grad_(True)
    w.requires_grad_(True)
    lp, ent = fused_linear_logprobs(x, w, torch.zeros(0, dtype=torch.long), with_entropy=True)
    assert lp.shape == (0,) and ent.shape == (0,)
    (lp.sum() + ent.sum()).backward()
    assert x.grad.shape == x.shape and torch.equal(w.grad, torch.zeros_like(w))


def test_shape_errors():
    x, w, target = _inputs()
    with pytest.raises(ValueError, match="disagree"):
        fused_linear_logprobs(x, w, target[:, :3])
    with pytest.raises(ValueError, match=r"\[V/TP, H\]"):
        fused_linear_logprobs(x, w[:, :5], target)
    with pytest.raises(ValueError, match="temperature"):
        fused_linear_logprobs(x, w, target, temperature=0.0)
