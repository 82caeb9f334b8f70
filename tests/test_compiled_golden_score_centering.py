"""Score centering through the compiled loss epilogue: verl's score-centering golden suite
(tests/test_golden_verl_score_centering.py: the loss, d loss / d logits and every verl metric at the README's
tolerances) with the verl adapter's loss compiled (helpers/compiled_golden.py), and, on one config with inductor, the
compiled loss equal to the eager one in float32 and float64 (the head's inputs ``rollout_topk_ids`` /
``rollout_topk_log_probs`` and the trainer head from one log-softmax of the logits), one compile whatever the batch
and sequence lengths, one host read per call.

By default (``make test``): a sample with the ``aot_eager`` backend and the inductor checks; every other case is the
opt-in sweep (``sweep`` marker, ``make test-sweep``)."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import test_golden_verl_score_centering as sc_suite
import torch
from helpers.compiled_golden import (
    SWEEP_BACKEND,
    assert_same_metrics,
    compiled_loss,
    compiled_verl_adapter,
    graph_outside_modes,
    graphs_of,
    sample_params,
)
from helpers.device_guard import count_host_syncs
from helpers.golden_verl_sc import adapter_call

from nemo_is_plugin.adapters.verl import policy_loss

SWEEP = pytest.mark.sweep
SAMPLE = {"case_002", "case_006"}  # ICEPOP band, token-mean; TIS, seq-mean-token-sum-norm
NEG_INF_SAMPLE = {"case_009"}  # -inf head slots, no IS, seq-mean-token-mean
INDUCTOR = "case_003"  # token TIS, seq-mean-token-mean
# (batch, sequence length) after the case's [3, 7] batch: other sizes, one compile (sizes 0 and 1 are specialised by
# torch, so none is used; 8 x 7 has as many rows as the head has slots, k = 8)
RESHAPES = ((2, 5), (3, 4), (8, 7))
BY_ID = {c["id"]: c for c in sc_suite.CASES}
TOLERANCE = {torch.float32: 2e-6, torch.float64: 1e-12}  # relative, as tests/loss/test_compiled.py
# The head gradient's absolute tolerance, relative to its largest entry: its coefficient q f(r) - alpha p cancels to 0
# on some slots; in float32 inductor's fused arithmetic leaves ~1e-9 there (6e-6 of the largest entry, measured)
HEAD_GRAD_TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-12}


@pytest.mark.parametrize("case", sample_params(sc_suite.SAME, SAMPLE, SWEEP))
def test_score_centering_golden_case_compiled(case, monkeypatch):
    with compiled_verl_adapter(monkeypatch, SWEEP_BACKEND):
        sc_suite.test_loss_gradient_and_metrics_match_verl(case)


@pytest.mark.parametrize("case", sample_params(sc_suite.NEG_INF, NEG_INF_SAMPLE, SWEEP))
def test_score_centering_neg_inf_slots_compiled(case, monkeypatch):
    with compiled_verl_adapter(monkeypatch, SWEEP_BACKEND):
        sc_suite.test_neg_inf_slots_are_empty_here_and_zero_mass_head_members_in_verl(case)


def test_score_centering_golden_case_inductor(monkeypatch):
    with compiled_verl_adapter(monkeypatch, "inductor"):
        sc_suite.test_loss_gradient_and_metrics_match_verl(BY_ID[INDUCTOR])


def resized(case: dict, batch: int, seq_len: int) -> dict:
    """The case on ``batch`` rows (its rows repeated) and its first ``seq_len`` positions, each tensor a fresh
    contiguous one as a verl micro-batch's (the verl step's global counts kept). Every call of a session must hand the
    graph the same kind of tensors: a view of a larger tensor after fresh ones (or the reverse), or a strided slice
    after contiguous ones, is another graph (dynamo guards on the view's base and on stride relations; the package's
    docstring, loss/compiled.py, says so)."""
    rows = -(-batch // case["params"]["generator"]["B"])
    tensors = {k: v.repeat(rows, *[1] * (v.dim() - 1))[:batch, :seq_len].clone() for k, v in case["inputs"].items()}
    return {**case, "inputs": tensors}


def adapter_inputs(case: dict, dtype: torch.dtype) -> tuple[Any, Any, Any]:
    """(the eager loss, its aligned inputs, their layout) of the verl adapter's call on ``case`` with the logits in
    ``dtype``: the head as verl passes it, the label's and the trainer head's log-probs from one log-softmax."""
    seen = []
    eager_run = policy_loss.run_loss

    def spy(loss_fn, inputs, layout, own, reads_mu):
        seen.append((loss_fn, inputs, layout))
        return eager_run(loss_fn, inputs, layout, own, reads_mu)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(policy_loss, "run_loss", spy)
        adapter_call(case, dtype=dtype)
    ((loss_fn, inputs, layout),) = seen
    assert inputs.head is not None and inputs.head.trainer_head is not None
    return loss_fn, inputs, layout


def loss_grads_metrics(run, inputs: Any) -> tuple[torch.Tensor, tuple[torch.Tensor, ...], Any]:
    """The loss, its gradients w.r.t. the label's and the trainer head's log-probs (the epilogue's inputs), metrics."""
    loss, metrics = run()
    grads = torch.autograd.grad(loss, (inputs.curr_logprobs, inputs.head.trainer_head))
    return loss.detach(), grads, metrics


@functools.cache
def inductor_runs(dtype: torch.dtype) -> tuple[int, list[tuple[tuple, tuple, int, int]]]:
    """The graphs the config's CompiledLoss held before, and per shape (the case's, then :data:`RESHAPES`): the eager
    and compiled (loss, gradients, metrics), the host reads of a second compiled call (backward included), and the
    graphs the CompiledLoss holds after the call."""
    case = BY_ID[INDUCTOR]
    before, out = None, []
    for batch, seq_len in ((3, 7), *RESHAPES):  # fresh tensors each: one kind of input (resized)
        loss_fn, inputs, layout = adapter_inputs(resized(case, batch, seq_len), dtype)
        compiled = compiled_loss(loss_fn, "inductor")
        before = graphs_of(compiled) if before is None else before
        got = loss_grads_metrics(lambda: compiled.compute(inputs, layout), inputs)  # noqa: B023
        assert compiled.compiled.compiled is not None  # compiled, not fallen back to the eager loss
        with graph_outside_modes(compiled), count_host_syncs() as syncs:
            loss_grads_metrics(lambda: compiled.compute(inputs, layout), inputs)  # noqa: B023
        want = loss_grads_metrics(lambda: loss_fn.compute(inputs, layout), inputs)  # noqa: B023
        out.append((want, got, len(syncs), graphs_of(compiled)))
    return before, out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_score_centering_inductor_equals_eager_in_one_compile(dtype):
    before, runs = inductor_runs(dtype)
    graphs = [graphs for *_, graphs in runs]
    # at most one graph for this dtype (none when an earlier test compiled it), none added for other lengths
    assert graphs[0] - before <= 1 and graphs == graphs[:1] * len(runs)
    tol = TOLERANCE[dtype]
    for (loss, grads, metrics), (c_loss, c_grads, c_metrics), _, _ in runs:
        assert c_loss.dtype == loss.dtype == dtype
        torch.testing.assert_close(c_loss, loss, rtol=tol, atol=tol)
        for c_grad, grad, atol in zip(c_grads, grads, (tol, HEAD_GRAD_TOLERANCE[dtype])):  # label's, trainer head's
            assert grad.abs().max() > 0
            torch.testing.assert_close(c_grad, grad, rtol=tol, atol=atol * grad.abs().max().item())
        assert_same_metrics(c_metrics, metrics, rtol=tol, atol=tol)
        assert any(k.startswith("score_centering_") for k in c_metrics)
        assert c_metrics.denominators == metrics.denominators


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_score_centering_compiled_reads_the_host_once(dtype):
    """The backward pass included: one read, the metrics'."""
    assert [syncs for _, _, syncs, _ in inductor_runs(dtype)[1]] == [1] * (1 + len(RESHAPES))
