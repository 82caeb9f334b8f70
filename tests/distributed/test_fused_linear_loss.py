"""Fused log-prob paths + ClippedPGLoss equal the naive reference (full logits -> log_softmax -> gather -> same loss):
loss, every metric, and the gradients of hidden states and LM-head weight, for every ratio level x IS level.

fp32: 1e-5 relative (metrics: 1e-5 relative + 1e-7 absolute, some are ~0). bf16 hidden/weight: log-probs, loss and
metrics computed in fp32 from the exact bf16 values, so the same 1e-5 against an fp32 reference on those values; the
gradients come back in bf16, one rounding of 2^-8 relative each: 1e-2 relative.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import nemo_is_plugin.distributed.head.fused_linear as fused_linear_module
from nemo_is_plugin import build_loss_fn
from nemo_is_plugin.apps.bench.paths import logprob_paths, naive_logprobs

from ._fused_cases import CHUNK, IS_LEVELS, RATIO_LEVELS, assert_metrics_close, level_config, problem, rel_err, run

FUSED_PATHS = [p for p in logprob_paths(chunk_size=CHUNK) if p.name != "naive"]


@pytest.mark.parametrize("path", FUSED_PATHS, ids=lambda p: p.name)
@pytest.mark.parametrize("ratio_level,is_level", list(itertools.product(RATIO_LEVELS, IS_LEVELS)))
def test_fp32_parity_every_level(path, ratio_level, is_level):
    p, cfg = problem(), level_config(ratio_level, is_level)
    ref_loss, ref_metrics, ref_dx, ref_dw = run(p, naive_logprobs, cfg)
    loss, metrics, dx, dw = run(p, path.fn, cfg)
    assert rel_err(loss, ref_loss) < 1e-5
    assert_metrics_close(metrics, ref_metrics)
    assert rel_err(dx, ref_dx) < 1e-5 and rel_err(dw, ref_dw) < 1e-5
    assert ref_dx.abs().max() > 0 and ref_dw.abs().max() > 0  # the loss actually reaches both inputs


def test_clipping_and_truncation_are_active_in_the_parity_problem():
    """The parity cases exercise the clipped branch and the TIS truncation, not only the identity region."""
    _, metrics, _, _ = run(problem(), naive_logprobs, level_config("token", "token"))
    assert 0 < metrics["is_oob_ratio"] < 1
    assert metrics["probs_ratio_clamped_min"] > metrics["probs_ratio_min"] or (
        metrics["probs_ratio_clamped_max"] < metrics["probs_ratio_max"]
    )


@pytest.mark.parametrize("ratio_level,is_level", [(r, "cumulative") for r in RATIO_LEVELS] + [("token", "sequence")])
def test_bf16_parity(ratio_level, is_level):
    p, cfg = problem(dtype=torch.bfloat16, seed=1), level_config(ratio_level, is_level)
    fused = next(x for x in FUSED_PATHS if x.name == "fused_linear")
    ref_loss, ref_metrics, ref_dx, ref_dw = run(p, naive_logprobs, cfg, p.hidden.float(), p.weight.float())
    loss, metrics, dx, dw = run(p, fused.fn, cfg)
    assert dx.dtype == torch.bfloat16 and dw.dtype == torch.bfloat16
    assert rel_err(loss, ref_loss) < 1e-5
    assert_metrics_close(metrics, ref_metrics)
    assert rel_err(dx, ref_dx) < 1e-2 and rel_err(dw, ref_dw) < 1e-2


@pytest.mark.parametrize("ratio_level,is_level", [("sequence", "sequence"), ("cumulative", "cumulative")])
def test_sequence_levels_run_first_pass_then_loss_then_recomputing_backward(monkeypatch, ratio_level, is_level):
    """With a custom autograd.Function that returns log-probs and saves only lse, plain autograd already orders the
    work as the sequence-level / cumulative levels need: every chunk's forward, then the loss on all log-probs, then
    one recomputation per chunk in the backward. The event log proves the order and the chunk count."""
    events: list[str] = []
    original = fused_linear_module.chunk_logits

    def logged_chunk_logits(*args, **kwargs):
        events.append("chunk")
        return original(*args, **kwargs)

    monkeypatch.setattr(fused_linear_module, "chunk_logits", logged_chunk_logits)
    p = problem()
    h, w = p.hidden.clone().requires_grad_(True), p.weight.clone().requires_grad_(True)
    lp = fused_linear_module.fused_linear_logprobs(h, w, p.target, chunk_size=CHUNK)
    events.append("forward done")
    loss, _ = build_loss_fn(level_config(ratio_level, is_level))(
        next_token_logprobs=lp,
        data=p.data,
        global_valid_seqs=p.global_valid_seqs,
        global_valid_toks=p.global_valid_toks,
    )
    events.append("loss done")
    loss.backward()

    n_chunks = -(-p.num_tokens // CHUNK)
    assert events == ["chunk"] * n_chunks + ["forward done", "loss done"] + ["chunk"] * n_chunks
    _, _, ref_dx, ref_dw = run(p, naive_logprobs, level_config(ratio_level, is_level))
    assert rel_err(h.grad, ref_dx) < 1e-5 and rel_err(w.grad, ref_dw) < 1e-5
