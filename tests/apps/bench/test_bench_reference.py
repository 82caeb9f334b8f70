"""The fp32 reference of the whole benchmark problem and the problem generator's options (device, true log-probs)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from nemo_is_plugin.apps.bench.jobs import bench_loss_fn, fwd_bwd_job
from nemo_is_plugin.apps.bench.paths import logprob_paths, naive_logprobs
from nemo_is_plugin.apps.bench.problem import make_problem, make_rl_batch, target_logprobs
from nemo_is_plugin.apps.bench.reference import compare, reference_loss_and_grads, rel_err


def _float64_autograd(problem):
    """loss, dX, dW by autograd through full float64 logits: the independent check of the hand-written reference."""
    h = problem.hidden.detach().double().requires_grad_(True)
    w = problem.weight.detach().double().requires_grad_(True)
    lp = torch.log_softmax(h @ w.t(), dim=-1).gather(-1, problem.target.unsqueeze(-1)).squeeze(-1)
    loss, _ = bench_loss_fn()(lp, problem.data, problem.global_valid_seqs, problem.global_valid_toks)
    loss.backward()
    return loss.detach(), h.grad, w.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_reference_equals_float64_autograd_across_chunks(dtype):
    p = make_problem(3, 17, 24, 300, seed=0, dtype=dtype, base_logprobs="model")
    ref = reference_loss_and_grads(p, bench_loss_fn(), chunk_bytes=300 * 8 * 5)  # 5-10 tokens a chunk, ragged end
    loss, dx, dw = _float64_autograd(p)
    tol = 1e-12 if dtype == torch.float64 else 2e-6
    assert ref.loss.dtype == dtype and ref.grad_hidden.shape == (48, 24) and ref.grad_weight.shape == (300, 24)
    assert abs(ref.loss.item() - loss.item()) <= tol * abs(loss.item())
    assert rel_err(ref.grad_hidden, dx.reshape(48, 24)) < tol and rel_err(ref.grad_weight, dw) < tol
    assert dx.abs().max() > 0 and dw.abs().max() > 0


def test_compare_reports_relative_errors_of_loss_and_both_gradients():
    p = make_problem(2, 9, 16, 64, seed=1, base_logprobs="model")
    ref = reference_loss_and_grads(p, bench_loss_fn())
    errs = compare(ref.loss * 1.01, ref.grad_hidden.view(2, 8, 16) + 0.5 * ref.grad_hidden.abs().max(), None, ref)
    assert errs["loss_err"] == pytest.approx(0.01, rel=1e-5)
    assert errs["dx_err"] == pytest.approx(0.5, rel=1e-5) and errs["dw_err"] is None
    # a bf16 run of the same problem: errors at bf16's resolution, not zero, not large
    pb = dataclasses.replace(p, hidden=p.hidden.bfloat16(), weight=p.weight.bfloat16())
    refb = reference_loss_and_grads(pb, bench_loss_fn())
    got = compare(*fwd_bwd_job(logprob_paths()[2], pb, bench_loss_fn())(), refb)
    assert 0 < got["dx_err"] < 1e-2 and 0 < got["dw_err"] < 1e-2 and got["loss_err"] < 1e-4


def test_rel_err_is_blockwise_max_abs_over_max_abs():
    want = torch.tensor([[1.0, -4.0], [2.0, 0.0], [0.5, 0.5]])
    got = want + torch.tensor([[0.0, 0.0], [0.0, 1.0], [-2.0, 0.0]])
    assert rel_err(got, want, block_rows=2) == pytest.approx(2.0 / 4.0)
    assert rel_err(None, want) is None


def test_target_logprobs_and_the_true_base_of_the_rl_batch():
    p = make_problem(3, 11, 8, 50, seed=3, base_logprobs="model")
    lp = target_logprobs(p.hidden, p.weight, p.target, chunk_bytes=50 * 4 * 4)
    torch.testing.assert_close(lp, naive_logprobs(p.hidden, p.weight, p.target), rtol=1e-6, atol=1e-6)
    # prev / generation / reference = the true log-probs + N(0, 0.05): ratios near 1
    for key in ("prev_logprobs", "generation_logprobs", "reference_policy_logprobs"):
        assert (p.data[key][:, 1:] - lp).abs().max() < 0.3
    stand_in = make_problem(3, 11, 8, 50, seed=3)
    assert (stand_in.data["prev_logprobs"][:, 1:] - lp).abs().max() > 1.0
    with pytest.raises(ValueError, match="base_logprobs"):
        make_problem(2, 5, 4, 10, base_logprobs="true")


def test_device_argument_on_cpu_changes_nothing_and_rl_batch_matches():
    a, b = make_problem(2, 9, 16, 37, seed=5), make_problem(2, 9, 16, 37, seed=5, device="cpu")
    assert torch.equal(a.hidden, b.hidden) and torch.equal(a.weight, b.weight) and torch.equal(a.target, b.target)
    rl = make_rl_batch(2, 9, 37, seed=5)
    assert rl.hidden is None and rl.target.shape == (2, 8) and rl.data["input_ids"].shape == (2, 9)
    assert torch.equal(rl.target, rl.data["input_ids"][:, 1:]) and rl.global_valid_toks > 0
