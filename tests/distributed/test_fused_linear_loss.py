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

import nemo_is_plugin.distributed.fused_linear as fused_linear_module
from nemo_is_plugin import build_loss_fn
from nemo_is_plugin.bench.paths import logprob_paths, naive_logprobs
from nemo_is_plugin.bench.problem import HeadProblem, make_problem

RATIO_LEVELS = ("token", "sequence", "sequence_token", "cumulative", "cumulative_mean")
IS_LEVELS = ("token", "sequence", "sequence_mean", "cumulative")
CHUNK = 5  # tokens per chunk: chunks straddle sequence boundaries (T = 8 per sequence)


def level_config(ratio_level: str, is_level: str) -> dict:
    """Tight clip and TIS band so that clipping and truncation are active on the synthetic mismatch."""
    return dict(
        ratio_level=ratio_level,
        is_correction_level=is_level,
        use_importance_sampling_correction=True,
        truncated_importance_sampling_type="tis",
        truncated_importance_sampling_ratio=1.05,
        ratio_clip_min=0.03,
        ratio_clip_max=0.03,
        loss_aggregation="seq-mean-token-mean" if ratio_level == "sequence" else "token-mean",
        token_level_loss=ratio_level != "sequence",
    )


def problem(dtype=torch.float32, seed=0, vocab=37) -> HeadProblem:
    """Tiny problem whose prev/gen/ref log-probs sit around the true ones (ratios near 1, both clip sides hit)."""
    p = make_problem(3, 9, 16, vocab, seed=seed)
    true_lp = naive_logprobs(p.hidden.double(), p.weight.double(), p.target)
    return make_problem(3, 9, 16, vocab, seed=seed, dtype=dtype, base_logprobs=true_lp)


def run(p: HeadProblem, logprob_fn, config: dict, hidden=None, weight=None):
    """(loss, metrics, d hidden, d weight) of ``loss_fn(logprob_fn(hidden, weight, target))``."""
    h = (p.hidden if hidden is None else hidden).clone().requires_grad_(True)
    w = (p.weight if weight is None else weight).clone().requires_grad_(True)
    loss_fn = build_loss_fn(config)
    lp = logprob_fn(h, w, p.target)
    loss, metrics = loss_fn(
        next_token_logprobs=lp, data=p.data, global_valid_seqs=p.global_valid_seqs,
        global_valid_toks=p.global_valid_toks,
    )
    loss.backward()
    return loss.detach(), metrics, h.grad, w.grad


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


def assert_metrics_close(got: dict, want: dict, rtol: float = 1e-5, atol: float = 1e-7) -> None:
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=rtol, abs=atol), key


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
        next_token_logprobs=lp, data=p.data, global_valid_seqs=p.global_valid_seqs,
        global_valid_toks=p.global_valid_toks,
    )
    events.append("loss done")
    loss.backward()

    n_chunks = -(-p.num_tokens // CHUNK)
    assert events == ["chunk"] * n_chunks + ["forward done", "loss done"] + ["chunk"] * n_chunks
    _, _, ref_dx, ref_dw = run(p, naive_logprobs, level_config(ratio_level, is_level))
    assert rel_err(h.grad, ref_dx) < 1e-5 and rel_err(w.grad, ref_dw) < 1e-5
