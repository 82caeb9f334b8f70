"""Score centering under context parallelism (2 gloo ranks, spawned once), float64: padded [B, T, k] and packed
[N, k] heads, load-balanced and contiguous order, f = 1 and TIS with batch normalisation (whose divisor spans both
shards), token-mean and sequence-mean aggregation. ``ClippedPGLoss.compute`` summed over the ranks equals the
single-process loss, each rank's gradient (through the label's and the head's log-probs) its shard of the
single-process one, and the score-centering metrics are the full-batch values on every rank."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from nemo_is_plugin.distributed.parallel.context_parallel import cp_layout
from nemo_is_plugin.distributed.parallel.cp_sharding import CP_ORDERS, shard_packed, shard_padded
from nemo_is_plugin.loss import ClippedPGLoss, LossInputs
from nemo_is_plugin.loss.layout import TokenLayout
from nemo_is_plugin.loss.score_centering import ScoreCenteringHead

WORLD = 2
B, T, K = 3, 8, 3  # T a multiple of 2 * WORLD (load-balanced chunks)
CU = [0, 8, 16, 24]
CONFIGS = [
    {"reference_policy_kl_penalty": 0.0, "score_centering": True},
    {
        "reference_policy_kl_penalty": 0.0,
        "score_centering": True,
        "use_importance_sampling_correction": True,
        "truncated_importance_sampling_type": "tis",
        "truncated_importance_sampling_ratio": 1.2,
        "importance_sampling_batch_normalize": True,
        "loss_aggregation": "seq-mean-token-mean",
    },
]


def _tensors(shape: tuple[int, ...], seed: int):
    """curr, prev, gen, adv, mask [*T]; trainer and sampler heads [*T, K] (an empty slot in places)."""
    g = torch.Generator().manual_seed(seed)
    prev = -(torch.rand(shape, generator=g, dtype=torch.float64) * 1.5 + 0.1)
    gen = (prev + 0.2 * torch.randn(shape, generator=g, dtype=torch.float64)).clamp(max=-1e-3)
    curr = prev.clone()
    head = -(torch.rand((*shape, K), generator=g, dtype=torch.float64) * 2 + 1.2)
    head_q = (head + 0.3 * torch.randn((*shape, K), generator=g, dtype=torch.float64)).clamp(max=-1.1)
    head_q.reshape(-1, K)[::5, 2] = -math.inf
    adv = torch.randn(shape, generator=g, dtype=torch.float64)
    return curr, prev, gen, adv, torch.ones(shape, dtype=torch.float64), head, head_q


def _cases(rank: int, order: str):
    t = _tensors((B, T), 1)
    t[4][2, 6:] = 0.0
    yield (
        t,
        TokenLayout.padded(B, T),
        lambda x: shard_padded(x, rank, WORLD, order),
        cp_layout(dist.group.WORLD, order, num_seqs=B, seq_len=T),
    )
    t = _tensors((CU[-1],), 2)
    t[4][22:] = 0.0
    yield (
        t,
        TokenLayout.packed(CU),
        lambda x: shard_packed(x, CU, rank, WORLD, order),
        cp_layout(dist.group.WORLD, order, cu_seqlens_padded=CU),
    )


def _inputs(c, p, g, a, m, h, hq, num_seqs):
    counts = (float(num_seqs), float(m.sum()))
    sm = torch.ones(num_seqs, dtype=c.dtype)
    ids = torch.zeros(h.shape, dtype=torch.long)  # the loss reads log-probs only
    return LossInputs(c, p, g, None, a, m, sm, *counts, head=ScoreCenteringHead(ids, hq, h))


def check_loss(rank: int, world: int) -> None:
    for config in CONFIGS:
        loss = ClippedPGLoss(config)
        for order in CP_ORDERS:
            for (c, p, g, a, m, h, hq), lay, shard, llay in _cases(rank, order):
                fc, fh = c.clone().requires_grad_(True), h.clone().requires_grad_(True)
                full = _inputs(fc, p, g, a, m, fh, hq, lay.num_seqs)
                full.global_valid_toks = float(m.sum())
                want, want_m = loss.compute(full, lay)
                want.backward()
                lc, lh = shard(c).clone().requires_grad_(True), shard(h).clone().requires_grad_(True)
                local = _inputs(lc, shard(p), shard(g), shard(a), shard(m), lh, shard(hq), lay.num_seqs)
                local.global_valid_toks = float(m.sum())
                got, metrics = loss.compute(local, llay)
                got.backward()
                total = got.detach().clone()
                dist.all_reduce(total)
                torch.testing.assert_close(total, want.detach(), rtol=1e-12, atol=1e-14)
                torch.testing.assert_close(lc.grad, shard(fc.grad), rtol=1e-12, atol=1e-14)
                torch.testing.assert_close(lh.grad, shard(fh.grad), rtol=1e-12, atol=1e-14)
                for name in [n for n in want_m if n.startswith("score_centering")]:
                    assert metrics[name] == pytest.approx(want_m[name], rel=1e-12, abs=1e-15), name
                assert want_m["score_centering_drift"] > 1e-3  # the term is at work


CHECKS = [("loss", check_loss)]


@pytest.mark.parametrize("name", [name for name, _ in CHECKS])
def test_score_centering_under_cp(gloo_results, name):
    assert name in gloo_results, f"check {name} did not run"
    assert gloo_results[name] is None, gloo_results[name]
