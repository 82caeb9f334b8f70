"""Score centering's head log-probs on 2 gloo ranks (spawned once), against the float64 full log-softmax gathered at
the label and the head ids (tests/helpers/head_reference.py), values and gradients, padding ids included:

- TP = 2, the head ids of a row on both vocab shards: the logits path (``vocab_parallel_logprobs``; each rank's
  logits gradient is its shard of the reference's), the fused two-pass head with entropy and temperature and the
  fused single pass (the full dX on every rank, each rank's dW rows), and sequence parallelism (dX reduce-scattered);
- CP = 2, Megatron's load-balanced and the contiguous order: the Megatron-layout head (``next_token_logprobs``)
  padded with full and CP-sharded head ids, and packed (THD): every CP rank gets the whole sequence's label and head
  log-probs; with each rank's loss divided by the CP size, each rank's dX is the reference's rows of its tokens and
  the dW summed over CP the reference's; the logits path on a CP shard (the ``[B, S, k]`` head ids aligned and
  sharded by the LOGIT entry point's helpers, ``next_token_aligned`` and the CP layout).
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist
from helpers.head_reference import head_ids_with_padding, head_loss, head_reference

from nemo_is_plugin.apps.bench.problem import vocab_shard
from nemo_is_plugin.distributed.entry_points.fused_linear_loss import _SinglePassFusedLoss, token_grad_step
from nemo_is_plugin.distributed.entry_points.logit_loss import next_token_aligned
from nemo_is_plugin.distributed.head.fused_linear import HeadOptions, fused_linear_logprobs
from nemo_is_plugin.distributed.head.sequence_head import SequenceLayout, next_token_logprobs
from nemo_is_plugin.distributed.head.vocab_parallel import vocab_parallel_logprobs
from nemo_is_plugin.distributed.parallel.context_parallel import cp_layout
from nemo_is_plugin.distributed.parallel.cp_sharding import shard_packed, shard_padded

WORLD = 2
GROUPS: dict[str, object] = {}
N, H, V, K = 12, 8, 30, 6
S, B = 8, 2
TOL = 1e-11


def setup_workers(rank: int, world_size: int) -> None:
    GROUPS["pair"] = dist.new_group(list(range(world_size)))


def _problem(seed: int):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=g, dtype=torch.float64) * 2.0
    weight = torch.randn(V, H, generator=g, dtype=torch.float64)
    target = torch.randint(0, V, (N,), generator=g)
    ids = head_ids_with_padding((N,), K, V, seed + 1)
    ids[3] = torch.tensor([0, V // 2, V - 1, V // 2 - 1, 1, V // 2 + 1])  # one row on both shards for sure
    c_label = torch.randn(N, generator=g, dtype=torch.float64)
    c_head = torch.randn(N, K, generator=g, dtype=torch.float64)
    return hidden, weight, target, ids, c_label, c_head


def _reference(hidden, weight, target, ids, c_label, c_head, temperature=1.0, entropy=False):
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    logits = h @ w.t() / temperature
    label, head = head_reference(logits, target, ids)
    loss = head_loss(label, head, c_label, c_head)
    if entropy:
        logp = torch.log_softmax(logits, -1)
        loss = loss - (logp.exp() * logp).sum()
    loss.backward()
    return label.detach(), head.detach(), h.grad, w.grad


def _close(got, want):
    finite = torch.isfinite(want)
    assert torch.equal(torch.isfinite(got), finite)
    torch.testing.assert_close(got[finite], want[finite], rtol=TOL, atol=TOL)


def _both_shards_hold_head_ids(ids) -> None:
    owners = {int(i) // (V // 2) for i in ids[3]}
    assert owners == {0, 1}


# ------------------------------------------------------------------------------------------------ TP = 2
def check_tp2_logits_path(rank: int, world: int) -> None:
    hidden, weight, target, ids, c_label, c_head = _problem(0)
    _both_shards_hold_head_ids(ids)
    logits = hidden @ weight.t()
    x = vocab_shard(logits.t(), rank, 2).t().contiguous().requires_grad_(True)  # columns [r V/2, (r+1) V/2)
    lp, ent, head = vocab_parallel_logprobs(x, target, GROUPS["pair"], chunk_size=5, with_entropy=True, head_ids=ids)
    (head_loss(lp, head, c_label, c_head) + ent.sum()).backward()
    xr = logits.clone().requires_grad_(True)
    label, ref = head_reference(xr, target, ids)
    logp = torch.log_softmax(xr, -1)
    (head_loss(label, ref, c_label, c_head) - (logp.exp() * logp).sum()).backward()
    _close(lp, label.detach())
    _close(head, ref.detach())
    torch.testing.assert_close(x.grad, vocab_shard(xr.grad.t(), rank, 2).t(), rtol=TOL, atol=TOL)


def check_tp2_fused_two_pass(rank: int, world: int) -> None:
    hidden, weight, target, ids, c_label, c_head = _problem(1)
    h, w = hidden.clone().requires_grad_(True), vocab_shard(weight, rank, 2).clone().requires_grad_(True)
    lp, ent, head = fused_linear_logprobs(
        h, w, target, GROUPS["pair"], chunk_size=5, temperature=0.8, with_entropy=True, head_ids=ids
    )
    (head_loss(lp, head, c_label, c_head) + ent.sum()).backward()
    label, ref, dx, dw = _reference(hidden, weight, target, ids, c_label, c_head, 0.8, entropy=True)
    _close(lp, label)
    _close(head, ref)
    torch.testing.assert_close(h.grad, dx, rtol=TOL, atol=TOL)
    torch.testing.assert_close(w.grad, vocab_shard(dw, rank, 2), rtol=TOL, atol=TOL)


def check_tp2_fused_single_pass(rank: int, world: int) -> None:
    hidden, weight, target, ids, c_label, c_head = _problem(2)
    h, w = hidden.clone().requires_grad_(True), vocab_shard(weight, rank, 2).clone().requires_grad_(True)
    seen = {}

    def finish(lp, head):
        seen["lp"], seen["head"] = lp, head
        return head_loss(lp, head, c_label, c_head).detach()

    opts = HeadOptions(GROUPS["pair"], 5, 1.0 / 0.8)
    loss = _SinglePassFusedLoss.apply(
        h, w, target, ids, token_grad_step(lambda sl, c, ch: (c_label[sl], c_head[sl])), finish, opts
    )
    loss.backward()
    label, ref, dx, dw = _reference(hidden, weight, target, ids, c_label, c_head, 0.8)
    _close(seen["lp"], label)
    _close(seen["head"], ref)
    torch.testing.assert_close(h.grad, dx, rtol=TOL, atol=TOL)
    torch.testing.assert_close(w.grad, vocab_shard(dw, rank, 2), rtol=TOL, atol=TOL)


def check_tp2_sequence_parallel(rank: int, world: int) -> None:
    hidden, weight, target, ids, c_label, c_head = _problem(3)
    rows = slice(rank * N // 2, (rank + 1) * N // 2)
    h, w = hidden[rows].clone().requires_grad_(True), vocab_shard(weight, rank, 2).clone().requires_grad_(True)
    lp, head = fused_linear_logprobs(h, w, target, GROUPS["pair"], chunk_size=5, sequence_parallel=True, head_ids=ids)
    head_loss(lp, head, c_label, c_head).backward()
    label, ref, dx, dw = _reference(hidden, weight, target, ids, c_label, c_head)
    _close(head, ref)
    torch.testing.assert_close(h.grad, dx[rows], rtol=TOL, atol=TOL)
    torch.testing.assert_close(w.grad, vocab_shard(dw, rank, 2), rtol=TOL, atol=TOL)


# ------------------------------------------------------------------------------------------------ CP = 2
def _sequence_problem(seed: int, rows: int, cols: int):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(rows, cols, H, generator=g, dtype=torch.float64)  # [s, b, H]
    weight = torch.randn(V, H, generator=g, dtype=torch.float64)
    labels = torch.randint(0, V, (cols, rows), generator=g)
    ids = head_ids_with_padding((cols, rows), K, V, seed + 1)
    c_label = torch.randn(cols, rows, generator=g, dtype=torch.float64)
    c_head = torch.randn(cols, rows, K, generator=g, dtype=torch.float64)
    return hidden, weight, labels, ids, c_label, c_head


def _cp_padded(order: str, sharded: bool):
    def check(rank: int, world: int) -> None:
        group = GROUPS["pair"]
        hidden, weight, labels, ids, c_label, c_head = _sequence_problem(4, S, B)
        h = shard_padded(hidden, rank, 2, order, dim=0).clone().requires_grad_(True)
        w = weight.clone().requires_grad_(True)
        given = [shard_padded(x, rank, 2, order, dim=1) if sharded else x for x in (labels, ids)]
        layout = SequenceLayout.build(cp_group=group, cp_order=order)
        lp, head = next_token_logprobs(h, w, given[0], None, layout, chunk_size=3, temperature=0.9, head_ids=given[1])
        (head_loss(lp, head, c_label, c_head) / 2).backward()  # every CP rank's loss is the whole sequence's / cp
        dw = w.grad.clone()
        dist.all_reduce(dw, group=group)
        hr, wr = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        logits = torch.einsum("sbh,vh->bsv", hr, wr) / 0.9
        label, ref = head_reference(logits, labels.roll(-1, dims=1), ids.roll(-1, dims=1))
        head_loss(label, ref, c_label, c_head).backward()
        assert head.shape == (B, S, K)
        _close(lp, label.detach())
        _close(head, ref.detach())
        torch.testing.assert_close(h.grad, shard_padded(hr.grad, rank, 2, order, dim=0), rtol=TOL, atol=TOL)
        torch.testing.assert_close(dw, wr.grad, rtol=TOL, atol=TOL)

    return check


def _cp_packed(order: str):
    def check(rank: int, world: int) -> None:
        group = GROUPS["pair"]
        cu = [0, 8, 12, 24]  # every sequence a multiple of 2 CP = 4
        T = cu[-1]
        hidden, weight, labels, ids, c_label, c_head = _sequence_problem(5, T, 1)
        h = shard_packed(hidden, cu, rank, 2, order).clone().requires_grad_(True)
        w = weight.clone().requires_grad_(True)
        given_ids = shard_packed(ids[0], cu, rank, 2, order).unsqueeze(0)
        layout = SequenceLayout.build(cu, group, order)
        lp, head = next_token_logprobs(h, w, labels, None, layout, chunk_size=5, head_ids=given_ids)
        (head_loss(lp, head, c_label[0], c_head[0]) / 2).backward()
        dw = w.grad.clone()
        dist.all_reduce(dw, group=group)
        nxt = torch.arange(1, T + 1)
        for a, b in zip(cu[:-1], cu[1:]):
            nxt[b - 1] = a
        hr, wr = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        label, ref = head_reference(hr[:, 0] @ wr.t(), labels[0, nxt], ids[0, nxt])
        head_loss(label, ref, c_label[0], c_head[0]).backward()
        assert head.shape == (T, K)
        _close(lp, label.detach())
        _close(head, ref.detach())
        torch.testing.assert_close(h.grad, shard_packed(hr.grad, cu, rank, 2, order), rtol=TOL, atol=TOL)
        torch.testing.assert_close(dw, wr.grad, rtol=TOL, atol=TOL)

    return check


def _cp_logits(order: str):
    """The logits path on this rank's CP shard of ``[B, S, V]``: the LOGIT entry point's alignment of ``[B, S]`` data
    (``next_token_aligned``, then the CP layout's tokens) carries the ``[B, S, k]`` head ids along."""

    def check(rank: int, world: int) -> None:
        hidden, weight, labels, ids, c_label, c_head = _sequence_problem(6, S, B)
        logits = torch.einsum("sbh,vh->bsv", hidden, weight)
        layout = cp_layout(GROUPS["pair"], order, num_seqs=B, seq_len=S)
        x = shard_padded(logits, rank, 2, order, dim=1).clone().requires_grad_(True)
        aligned_t, aligned_ids = next_token_aligned(labels, S), next_token_aligned(ids, S)
        local_t = aligned_t[layout.seq_index, layout.position]
        local_ids = aligned_ids[layout.seq_index, layout.position]
        local_c = c_label[layout.seq_index, layout.position], c_head[layout.seq_index, layout.position]
        lp, head = vocab_parallel_logprobs(x, local_t, chunk_size=3, head_ids=local_ids)
        head_loss(lp, head, *local_c).backward()
        xr = logits.clone().requires_grad_(True)
        label, ref = head_reference(xr, aligned_t, aligned_ids)
        sel = layout.seq_index, layout.position
        head_loss(label[sel], ref[sel], *local_c).backward()
        _close(lp, label[sel].detach())
        _close(head, ref[sel].detach())
        torch.testing.assert_close(x.grad, shard_padded(xr.grad, rank, 2, order, dim=1), rtol=TOL, atol=TOL)

    return check


ORDERS = ("load_balanced", "contiguous")
CHECKS = [
    ("tp2_logits_path", check_tp2_logits_path),
    ("tp2_fused_two_pass", check_tp2_fused_two_pass),
    ("tp2_fused_single_pass", check_tp2_fused_single_pass),
    ("tp2_sequence_parallel", check_tp2_sequence_parallel),
    *[
        (f"cp2_padded_{order}_{'sharded' if sharded else 'full'}_ids", _cp_padded(order, sharded))
        for order, sharded in itertools.product(ORDERS, (True, False))
    ],
    *[(f"cp2_packed_{order}", _cp_packed(order)) for order in ORDERS],
    *[(f"cp2_logits_{order}", _cp_logits(order)) for order in ORDERS],
]


@pytest.mark.parametrize("name", [name for name, _ in CHECKS])
def test_head_logprobs_parallel(gloo_results, name):
    assert gloo_results[name] is None, gloo_results[name]
