"""Edge inputs through the fused LM-head loss (``fused_linear_pg_loss``): a third of the config grid of
``helpers.config_space`` x the edge inputs that reach the fused path (non-finite and huge generation / old / reference
log-probs, valid and masked, empty rows, an all-masked batch), float64, vocabulary 11.

The single pass (where the config and layout allow it: the IS correction is computed once, before the chunks, and
each chunk's gradient from it) and the two passes each give the naive loss's results (``loss_fn`` on the full-logit
log-probs): loss, metrics, the gradients of the hidden states and of the head, or the same refusal.
"""

from __future__ import annotations

import pytest
import torch
from helpers.config_space import build, config_grid, row_id
from helpers.edge_inputs import EDGE_INPUTS, KEYS, base_batch

from nemo_is_plugin import TokenLayout, build_loss_fn
from nemo_is_plugin.distributed.entry_points.fused_linear_loss import fused_linear_pg_loss
from nemo_is_plugin.loss.output_checks import NonFiniteLossError
from nemo_is_plugin.loss.separable import single_pass_blocker

# Every third config, score centering's included (the head's log-probs from the labels' pass, kernels/head_ids.py).
ROWS = config_grid().rows[::3]
IDS = [row_id(r)[:90] for r in ROWS]
NAMES = {"clean", "empty_row", "all_tokens_masked", "positive_rounding", "gen=nan@pad", "prev=huge@pad"}
NAMES |= {f"gen={v}@valid" for v in ("-inf", "+inf", "nan", "huge")} | {"prev=huge@valid", "prev=nan@valid"}
NAMES |= {"gen=-inf@first", "gen=-inf@two_rows", "gen=-inf+nan@same_row", "ref=huge@valid", "ref=nan@valid"}
EDGES = [e for e in EDGE_INPUTS if e.name in NAMES]
VOCAB, HIDDEN, CHUNK = 11, 8, 5


def head_case(edge):
    """(hidden, weight, target, data): the edge's batch with its clean log-probs moved onto the head's own, so that
    the ratios sit near 1 (each tensor keeps its offset from the base batch's current log-probs)."""
    curr, data = edge.batch(torch.float64)
    base_curr, base = base_batch(torch.float64)
    g = torch.Generator().manual_seed(5)
    b, t = curr.shape
    hidden = torch.randn(b, t, HIDDEN, generator=g, dtype=torch.float64)
    weight = torch.randn(VOCAB, HIDDEN, generator=g, dtype=torch.float64) * 0.5
    target = torch.randint(0, VOCAB, (b, t), generator=g)
    true = torch.log_softmax(hidden @ weight.T, -1).gather(-1, target[..., None])[..., 0]
    for key in KEYS.values():
        same = (data[key] == base[key])[:, 1:]
        data[key][:, 1:] = torch.where(same, true + (base[key][:, 1:] - base_curr), data[key][:, 1:])
    return hidden, weight, target, data


def run(cfg, case, mode):
    hidden, weight, target, data = case
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    sm = data["sample_mask"]
    n_seq, n_tok = sm.sum(), (data["token_mask"][:, 1:] * sm[:, None]).sum()
    loss_fn = build_loss_fn(cfg)
    try:
        if mode == "naive":
            logp = torch.log_softmax(h @ w.T, -1)
            lp = logp.gather(-1, target[..., None])[..., 0]
            if "rollout_topk_ids" in data:  # score centering's head from the same log-softmax
                data = {**data, "curr_topk_logprobs": logp.gather(-1, data["rollout_topk_ids"][:, 1:])}
            loss, metrics = loss_fn(lp, data, n_seq, n_tok)
        else:
            data = {k: v for k, v in data.items() if k != "curr_topk_logprobs"}  # the fused head computes it
            kw = dict(chunk_size=CHUNK, single_pass=None if mode == "single" else False)
            loss, metrics = fused_linear_pg_loss(loss_fn, h, w, target, data, n_seq, n_tok, **kw)
    except ValueError as exc:
        return exc
    if loss.requires_grad:
        loss.backward()
    zeros = torch.zeros_like
    return loss.detach(), dict(metrics), zeros(h) if h.grad is None else h.grad, zeros(w) if w.grad is None else w.grad


@pytest.mark.filterwarnings("ignore::UserWarning")  # the tolerant mode's one-time warnings
@pytest.mark.parametrize("index", range(len(ROWS)), ids=IDS)
def test_edge_inputs_through_the_fused_loss_equal_the_naive_loss(index):
    cfg = build(ROWS[index])
    modes = ["two_pass"] + (["single"] if single_pass_blocker(cfg, TokenLayout.padded(4, 7)) is None else [])
    assert len(EDGES) == len(NAMES)
    for edge in EDGES:
        case = head_case(edge)
        want = run(cfg, case, "naive")
        for mode in modes:
            got = run(cfg, case, mode)
            where = f"{IDS[index]} / {edge.name} / {mode}"
            if isinstance(want, Exception):
                assert type(got) is type(want) and str(got) == str(want), f"{where}: {got!r} vs {want!r}"
                continue
            assert not isinstance(got, Exception), f"{where}: {got!r}"
            loss, metrics, dh, dw = got
            assert torch.isfinite(loss) and torch.isfinite(dh).all() and torch.isfinite(dw).all(), where
            torch.testing.assert_close(loss, want[0], rtol=1e-9, atol=1e-12, msg=where)
            torch.testing.assert_close(dh, want[2], rtol=1e-8, atol=1e-12, msg=where)
            torch.testing.assert_close(dw, want[3], rtol=1e-8, atol=1e-12, msg=where)
            for k, v in want[1].items():
                assert metrics[k] == pytest.approx(v, rel=1e-9, abs=1e-12, nan_ok=True), (where, k)


@pytest.mark.parametrize("single_pass", [None, False])
def test_an_overflowing_policy_ratio_is_refused_by_the_fused_loss(single_pass):
    """float32: prev 120 nats below the head's log-prob on a valid token overflows exp(c - prev); the fused loss
    refuses it as the loss itself does (the single pass computes its gradients first, then the same check)."""
    edge = next(e for e in EDGE_INPUTS if e.name == "prev=huge@valid")
    hidden, weight, target, data = head_case(edge)
    data = {k: v.float() if v.is_floating_point() else v for k, v in data.items()}
    data["advantages"][edge.positions[0]] = -1.0  # PPO's unclipped branch: -A exp(c - prev)
    n_seq, n_tok = data["sample_mask"].sum(), (data["token_mask"][:, 1:] * data["sample_mask"][:, None]).sum()
    h, w = hidden.float().requires_grad_(True), weight.float().requires_grad_(True)
    with pytest.raises(NonFiniteLossError, match="prev_logprobs on a valid token is 1"):
        fused_linear_pg_loss(
            build_loss_fn({}), h, w, target, data, n_seq, n_tok, chunk_size=CHUNK, single_pass=single_pass
        )
