"""Score centering through the entry points on 2 gloo ranks (spawned once), float64, against the plain loss on one
full log-softmax gathered at the labels and the head ids (tests/distributed/_centering_cases.py):

- TP = 2 (the head ids of a row on both vocab shards): the fused hidden-state loss in its single pass and in two
  passes (the full dX on every rank, each rank's dW rows) and the LOGIT entry on vocab-sharded logits (each rank's
  logits gradient its shard of the reference's);
- CP = 2, load-balanced and contiguous order, padded and packed: the LOGIT entry on this rank's sequence shard (the
  ``[B, S, k]`` head aligned and sharded with the other token tensors): the losses summed over CP equal the
  reference's, the metrics equal it on every rank, each rank's logits gradient is its shard of the reference's.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist
from helpers.head_reference import head_reference

from nemo_is_plugin import build_loss_fn
from nemo_is_plugin.apps.bench.problem import vocab_shard
from nemo_is_plugin.distributed.entry_points.fused_linear_loss import fused_linear_pg_loss
from nemo_is_plugin.distributed.entry_points.logit_loss import LogitClippedPGLoss
from nemo_is_plugin.distributed.parallel.collectives import all_reduce_sum
from nemo_is_plugin.distributed.parallel.cp_sharding import shard_packed, shard_padded

from ._centering_cases import CONFIGS, centering_problem
from ._fused_cases import assert_metrics_close
from ._loss_cases import cu_seqlens, pack, padded_lengths

WORLD = 2
GROUPS: dict[str, object] = {}
TOL = 1e-10


def setup_workers(rank: int, world_size: int) -> None:
    GROUPS["pair"] = dist.new_group(list(range(world_size)))


def _problem():
    p = centering_problem(dtype=torch.float64)
    ids = p.data["rollout_topk_ids"]
    ids[0, 3, :2] = torch.tensor([1, p.weight.shape[0] - 2])  # one row's ids on both vocab shards for sure
    return p


def _reference_on_logits(p, config):
    """float64 ``(loss, metrics, d logits [B, S, V])`` of the plain loss; logits ``[B, S, V]`` whose last position
    (which predicts nothing) is a copy of the first."""
    logits = p.hidden @ p.weight.t()
    full = torch.cat([logits, logits[:, :1]], 1).requires_grad_(True)
    label, head = head_reference(full[:, :-1], p.target, p.data["rollout_topk_ids"][:, 1:])
    loss, metrics = build_loss_fn(config)(
        label, {**p.data, "curr_topk_logprobs": head}, p.global_valid_seqs, p.global_valid_toks
    )
    loss.backward()
    return loss.detach(), metrics, full.detach(), full.grad


def _close(got, want):
    torch.testing.assert_close(got, want, rtol=TOL, atol=TOL)


def _tp_fused(name: str, single_pass: bool):
    def check(rank: int, world: int) -> None:
        p, cfg = _problem(), CONFIGS[name]
        h = p.hidden.clone().requires_grad_(True)
        w = vocab_shard(p.weight, rank, 2).clone().requires_grad_(True)
        loss, metrics = fused_linear_pg_loss(
            build_loss_fn(cfg),
            h,
            w,
            p.target,
            p.data,
            p.global_valid_seqs,
            p.global_valid_toks,
            GROUPS["pair"],
            chunk_size=5,
            single_pass=single_pass,
        )
        loss.backward()
        hr, wr = p.hidden.clone().requires_grad_(True), p.weight.clone().requires_grad_(True)
        label, head = head_reference(hr @ wr.t(), p.target, p.data["rollout_topk_ids"][:, 1:])
        want, want_metrics = build_loss_fn(cfg)(
            label, {**p.data, "curr_topk_logprobs": head}, p.global_valid_seqs, p.global_valid_toks
        )
        want.backward()
        _close(loss, want.detach())
        assert_metrics_close(metrics, want_metrics, rtol=TOL, atol=TOL)
        _close(h.grad, hr.grad)
        _close(w.grad, vocab_shard(wr.grad, rank, 2))

    return check


def _tp_logits(name: str):
    def check(rank: int, world: int) -> None:
        p, cfg = _problem(), CONFIGS[name]
        want, want_metrics, full, want_grad = _reference_on_logits(p, cfg)
        per = full.shape[-1] // 2
        x = full[..., rank * per : (rank + 1) * per].clone().requires_grad_(True)
        fn = LogitClippedPGLoss(build_loss_fn(cfg), chunk_size=5)
        loss, metrics = fn(x, p.data, p.global_valid_seqs, p.global_valid_toks, vocab_parallel_group=GROUPS["pair"])
        loss.backward()
        _close(loss, want)
        assert_metrics_close(metrics, want_metrics, rtol=TOL, atol=TOL)
        _close(x.grad, want_grad[..., rank * per : (rank + 1) * per])

    return check


def _cp_logits(name: str, order: str, packed: bool):
    def check(rank: int, world: int) -> None:
        p, cfg = _problem(), CONFIGS[name]
        want, want_metrics, full, want_grad = _reference_on_logits(p, cfg)
        batch, seq = full.shape[:2]
        call = {}
        if packed:
            lengths = padded_lengths([seq] * batch, 4)
            cu = cu_seqlens(lengths)
            local = shard_packed(pack(full, lengths, 3.0), cu, rank, 2, order).unsqueeze(0)
            grad_local = shard_packed(pack(want_grad, lengths, 0.0), cu, rank, 2, order).unsqueeze(0)
            call["cu_seqlens_padded"] = cu
        else:
            width = -(-seq // 4) * 4  # a multiple of 2 CP
            filler = torch.full((batch, width - seq, full.shape[-1]), 3.0, dtype=full.dtype)
            local = shard_padded(torch.cat([full, filler], 1), rank, 2, order)
            grad_local = shard_padded(torch.cat([want_grad, torch.zeros_like(filler)], 1), rank, 2, order)
        x = local.clone().requires_grad_(True)
        fn = LogitClippedPGLoss(build_loss_fn(cfg), cp_order=order, chunk_size=5)
        loss, metrics = fn(
            x, p.data, p.global_valid_seqs, p.global_valid_toks, context_parallel_group=GROUPS["pair"], **call
        )
        loss.backward()
        _close(all_reduce_sum(loss.detach(), GROUPS["pair"]), want)
        assert_metrics_close(metrics, want_metrics, rtol=TOL, atol=TOL)
        _close(x.grad, grad_local)

    return check


CHECKS = [
    *[
        (f"tp2_fused_{name}_{'single' if single else 'two'}_pass", _tp_fused(name, single))
        for name, single in itertools.product(("tis", "icepop"), (True, False))
    ],
    *[(f"tp2_logits_{name}", _tp_logits(name)) for name in ("tis", "no_is")],
    *[
        (f"cp2_logits_{order}_{'packed' if packed else 'padded'}", _cp_logits("icepop", order, packed))
        for order, packed in itertools.product(("load_balanced", "contiguous"), (False, True))
    ],
]


@pytest.mark.parametrize("name", [name for name, _ in CHECKS])
def test_score_centering_parallel(gloo_results, name):
    assert gloo_results[name] is None, gloo_results[name]
