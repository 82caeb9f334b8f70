"""fused_linear_pg_loss beyond parity of values: upstream gradients, requires_grad / no_grad handling, which chunk
GEMMs run in the forward and in the backward of each schedule, and explicit / packed layouts (against the naive path
with the same layout). Helpers and tolerances: test_fused_linear_pg_loss.py.
"""

from __future__ import annotations

import pytest
import torch

import nemo_is_plugin.distributed.entry_points.fused_linear_loss as fused_loss_module
import nemo_is_plugin.distributed.head.fused_linear as fused_linear_module
from nemo_is_plugin import build_loss_fn
from nemo_is_plugin.apps.bench.paths import naive_logprobs
from nemo_is_plugin.distributed.entry_points.fused_linear_loss import fused_linear_pg_loss
from nemo_is_plugin.loss.layout import TokenLayout

from ._fused_cases import (
    CHUNK,
    aggregation,
    assert_metrics_close,
    assert_parity,
    forbid,
    fused,
    level_config,
    rel_err,
    run,
)
from ._fused_cases import pg_problem as problem


# ---------------------------------------------------------------------------------------------------- autograd
@pytest.mark.parametrize("ratio_level", ["token", "sequence"])
def test_upstream_gradient_scales_the_gradients(ratio_level):
    p, cfg = problem(), level_config(ratio_level, "token")
    _, _, dx1, dw1 = fused(p, cfg)
    loss, _, dx, dw = fused(p, cfg, upstream=2.5)
    assert rel_err(dx, 2.5 * dx1) < 1e-6 and rel_err(dw, 2.5 * dw1) < 1e-6
    h, w = p.hidden.clone().requires_grad_(True), p.weight.clone().requires_grad_(True)
    ref, _ = build_loss_fn(cfg)(naive_logprobs(h, w, p.target), p.data, p.global_valid_seqs, p.global_valid_toks)
    (2.5 * ref).backward()
    assert rel_err(dx, h.grad) < 1e-5 and rel_err(dw, w.grad) < 1e-5
    assert rel_err(loss, ref.detach()) < 1e-5


def test_negative_and_tensor_upstream_gradient():
    p, cfg = problem(), level_config("token", "token")
    _, _, dx1, dw1 = fused(p, cfg)
    _, _, dx, dw = fused(p, cfg, upstream=torch.tensor(-0.5))
    assert rel_err(dx, -0.5 * dx1) < 1e-6 and rel_err(dw, -0.5 * dw1) < 1e-6


@pytest.mark.parametrize("ratio_level", ["token", "sequence"])
def test_only_the_inputs_that_require_grad_get_one(ratio_level):
    p, cfg = problem(), level_config(ratio_level, "token")
    _, _, ref_dx, ref_dw = run(p, naive_logprobs, cfg)
    loss, _, dx, dw = fused(p, cfg, h_grad=False)
    assert dx is None and rel_err(dw, ref_dw) < 1e-5
    loss, _, dx, dw = fused(p, cfg, w_grad=False)
    assert dw is None and rel_err(dx, ref_dx) < 1e-5


def test_no_input_requires_grad_gives_a_constant_loss():
    p, cfg = problem(), level_config("token", "token")
    ref_loss, ref_metrics, _, _ = run(p, naive_logprobs, cfg)
    h, w = p.hidden.clone(), p.weight.clone()
    loss, metrics = fused_linear_pg_loss(
        build_loss_fn(cfg), h, w, p.target, p.data, p.global_valid_seqs, p.global_valid_toks, chunk_size=CHUNK
    )
    assert not loss.requires_grad
    assert rel_err(loss, ref_loss) < 1e-5
    assert_metrics_close(metrics, ref_metrics)


@pytest.mark.parametrize("ratio_level", ["token", "sequence"])
def test_no_grad_returns_loss_and_metrics_without_gradients(monkeypatch, ratio_level):
    p, cfg = problem(), level_config(ratio_level, "token")
    ref_loss, ref_metrics, _, _ = run(p, naive_logprobs, cfg)
    forbid(monkeypatch, fused_loss_module, "the single pass (it computes gradients in its forward)")
    h, w = p.hidden.clone().requires_grad_(True), p.weight.clone().requires_grad_(True)
    with torch.no_grad():
        loss, metrics = fused_linear_pg_loss(
            build_loss_fn(cfg), h, w, p.target, p.data, p.global_valid_seqs, p.global_valid_toks, chunk_size=CHUNK
        )
    assert not loss.requires_grad and loss.grad_fn is None
    assert h.grad is None and w.grad is None
    assert rel_err(loss, ref_loss) < 1e-5
    assert_metrics_close(metrics, ref_metrics)


# ---------------------------------------------------------------------------------------------------- schedule
def _log_chunks(monkeypatch, events):
    for module, tag in ((fused_loss_module, "single"), (fused_linear_module, "two_pass")):
        original = module.chunk_logits

        def logged(*args, _original=original, _tag=tag, **kwargs):
            events.append(_tag)
            return _original(*args, **kwargs)

        monkeypatch.setattr(module, "chunk_logits", logged)


def _logged_run(monkeypatch, cfg, chunk_size):
    """Event log of chunk GEMMs around forward / backward, the problem, and the gradients of fused_linear_pg_loss."""
    events: list[str] = []
    _log_chunks(monkeypatch, events)
    p = problem()
    h, w = p.hidden.clone().requires_grad_(True), p.weight.clone().requires_grad_(True)
    loss, _ = fused_linear_pg_loss(
        build_loss_fn(cfg), h, w, p.target, p.data, p.global_valid_seqs, p.global_valid_toks, chunk_size=chunk_size
    )
    events.append("forward done")
    loss.backward()
    events.append("backward done")
    return events, p, h.grad, w.grad


@pytest.mark.parametrize("ratio_level", ["token", "cumulative"])
@pytest.mark.parametrize("chunk_size", [CHUNK, 7])
def test_single_pass_runs_every_chunk_gemm_in_the_forward_and_none_in_the_backward(
    monkeypatch, chunk_size, ratio_level
):
    cfg = level_config(ratio_level, "cumulative")
    events, p, dx, dw = _logged_run(monkeypatch, cfg, chunk_size)
    n_chunks = -(-p.num_tokens // chunk_size)
    assert n_chunks > 1
    assert events == ["single"] * n_chunks + ["forward done", "backward done"]
    _, _, ref_dx, ref_dw = run(p, naive_logprobs, cfg)
    assert rel_err(dx, ref_dx) < 1e-5 and rel_err(dw, ref_dw) < 1e-5


def test_two_pass_recomputes_every_chunk_in_the_backward(monkeypatch):
    events, p, _, _ = _logged_run(monkeypatch, level_config("sequence", "sequence"), CHUNK)
    n_chunks = -(-p.num_tokens // CHUNK)
    assert events == ["two_pass"] * n_chunks + ["forward done"] + ["two_pass"] * n_chunks + ["backward done"]


# ---------------------------------------------------------------------------------------------------- layouts
def _row_layout(batch: int, seq_len: int) -> TokenLayout:
    """The padded [B, T] layout written out without the padded fast paths (index_add / segmented cumsum)."""
    rows = torch.arange(batch).unsqueeze(1).expand(batch, seq_len)
    cols = torch.arange(seq_len).unsqueeze(0).expand(batch, seq_len)
    return TokenLayout(rows, cols, batch)


LAYOUT_CONFIGS = {
    "cumulative_is_log_clip": dict(
        level_config("token", "cumulative"),
        log_ratio_clip_low=0.01,
        log_ratio_clip_high=0.015,
        clip_position_power=0.5,
    ),
    "seq_mask_tis_seq_mean": aggregation(
        "seq-mean-token-mean",
        truncated_importance_sampling_type="seq-mask-tis",
        truncated_importance_sampling_ratio=1.03,
        truncated_importance_sampling_ratio_min=0.97,
        reference_policy_kl_penalty=0.1,
    ),
    "sequence_ratio_two_pass": level_config("sequence", "sequence_mean"),
}


def _run_with_layout(p, cfg, logprob_fn, layout, data, target, hidden):
    h, w = hidden.clone().requires_grad_(True), p.weight.clone().requires_grad_(True)
    loss, metrics = build_loss_fn(cfg)(
        logprob_fn(h, w, target), data, p.global_valid_seqs, p.global_valid_toks, layout=layout
    )
    loss.backward()
    return loss.detach(), metrics, h.grad, w.grad


@pytest.mark.parametrize("name", sorted(LAYOUT_CONFIGS))
def test_explicit_non_padded_layout(name):
    """An explicit layout (the padded batch's, without the padded fast paths) reaches the loss and the per-token
    constants: equals the naive path with the same layout, and the default padded layout."""
    p, cfg = problem(), LAYOUT_CONFIGS[name]
    layout = _row_layout(*p.target.shape)
    want = _run_with_layout(p, cfg, naive_logprobs, layout, p.data, p.target, p.hidden)
    assert_parity(fused(p, cfg, layout=layout), want)
    assert_parity(want, run(p, naive_logprobs, cfg))


def _pack_problem(p, lengths):
    """The first ``lengths[i]`` next-token positions of each row of ``p``, packed into one [1, N] row (THD)."""

    def pack_tokens(x):  # [B, T, ...] -> [1, N, ...]
        return torch.cat([x[i, :n] for i, n in enumerate(lengths)]).unsqueeze(0)

    data = {}
    for key, value in p.data.items():
        if value.dim() == 2:  # [B, S]: column 0 is never read; keep one column in front of the packed tokens
            data[key] = torch.cat([value[:1, :1], pack_tokens(value[:, 1:])], dim=1)
        else:
            data[key] = value
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist())
    return pack_tokens(p.hidden), pack_tokens(p.target), data, TokenLayout.packed(cu)


@pytest.mark.parametrize("name", sorted(LAYOUT_CONFIGS))
def test_packed_single_sequence(name):
    """A packed [1, N] batch with one sequence (the problem's rows concatenated, masks kept)."""
    p, cfg = problem(), LAYOUT_CONFIGS[name]
    hidden, target, data, _ = _pack_problem(p, [8, 8, 8])
    data["sample_mask"], data["rewards"] = torch.ones(1), torch.ones(1)
    p.global_valid_seqs, p.global_valid_toks = 1.0, float(data["token_mask"][:, 1:].sum())
    layout = TokenLayout.packed([0, target.shape[1]])
    assert tuple(layout.shape) == (24,) and tuple(target.shape) == (1, 24)
    want = _run_with_layout(p, cfg, naive_logprobs, layout, data, target, hidden)
    got = fused(p, cfg, hidden=hidden, data=data, target=target, layout=layout)
    assert_parity(got, want)


def test_packed_several_sequences():
    p, cfg = problem(), LAYOUT_CONFIGS["cumulative_is_log_clip"]
    lengths = [5, 8, 7]
    hidden, target, data, layout = _pack_problem(p, lengths)
    want = _run_with_layout(p, cfg, naive_logprobs, layout, data, target, hidden)
    got = fused(p, cfg, hidden=hidden, data=data, target=target, layout=layout)
    assert_parity(got, want)
