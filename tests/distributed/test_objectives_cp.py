"""The objectives that need whole sequences (GMPO's sequence ratio, CPPO's prefix budget) under context parallelism
equal the single-process values (2 gloo ranks, spawned once; padded and packed, load-balanced and contiguous order).

Each rank holds the full batch, computes the single-process reference, and checks its shard: GMPO's per-token loss
and its gradient, CPPO's keep mask, budget-bound tokens and first exhausted position (the per-sequence 0.9-quantile
passed in, as the caller gathers it under CP). float64 inputs: equal to 1e-12.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from nemo_is_plugin.distributed.parallel.context_parallel import cp_layout
from nemo_is_plugin.distributed.parallel.cp_sharding import CP_ORDERS, shard_packed, shard_padded
from nemo_is_plugin.loss import ClippedPGLoss, LossInputs
from nemo_is_plugin.loss.layout import TokenLayout
from nemo_is_plugin.loss.objectives.cppo import BUDGET_QUANTILE, cppo_mask, sequence_quantile
from nemo_is_plugin.loss.objectives.gmpo import gmpo_surrogate

WORLD = 2
B, T = 3, 24  # T a multiple of 2 * WORLD (load-balanced chunks)
CU = [0, 8, 24, 48]  # packed sequences of 8, 16 and 24 tokens
CPPO = dict(delta=0.2, w_min=0.8, delta_b=0.02)


def _batch(n_tokens_shape: tuple[int, ...], seed: int):
    g = torch.Generator().manual_seed(seed)
    anchor = torch.log(0.02 + 0.96 * torch.rand(n_tokens_shape, generator=g, dtype=torch.float64))
    curr = torch.minimum(
        anchor + 0.6 * torch.randn(n_tokens_shape, generator=g, dtype=torch.float64), -1e-4 + 0 * anchor
    )
    adv = torch.randn(n_tokens_shape, generator=g, dtype=torch.float64)
    mask = torch.ones(n_tokens_shape, dtype=torch.float64)
    return curr, anchor, adv, mask


def _cases(rank: int, order: str):
    """(full tensors, full layout, local tensors, local layout) for padded and packed batches."""
    curr, anchor, adv, mask = _batch((B, T), seed=1)
    mask[1, 18:] = 0  # trailing padding
    mask[2, 5] = 0  # interior
    shard = lambda x: shard_padded(x, rank, WORLD, order)  # noqa: E731
    yield (
        (curr, anchor, adv, mask),
        TokenLayout.padded(B, T),
        tuple(shard(x) for x in (curr, anchor, adv, mask)),
        cp_layout(dist.group.WORLD, order, num_seqs=B, seq_len=T),
    )
    curr, anchor, adv, mask = _batch((CU[-1],), seed=2)
    mask[20] = 0
    pshard = lambda x: shard_packed(x, CU, rank, WORLD, order)  # noqa: E731
    yield (
        (curr, anchor, adv, mask),
        TokenLayout.packed(CU),
        tuple(pshard(x) for x in (curr, anchor, adv, mask)),
        cp_layout(dist.group.WORLD, order, cu_seqlens_padded=CU),
    )


def _local(full: torch.Tensor, rank: int, order: str) -> torch.Tensor:
    if full.dim() == 2:
        return shard_padded(full, rank, WORLD, order)
    return shard_packed(full, CU, rank, WORLD, order)


def check_gmpo(rank: int, world: int) -> None:
    for order in CP_ORDERS:
        for (c, a, A, m), lay, (lc, la, lA, lm), llay in _cases(rank, order):
            c = c.clone().requires_grad_(True)
            want = gmpo_surrogate(c, a, A, m, lay, clip_low=0.2, clip_high=0.3)
            (want.loss * m).sum().backward()
            lc = lc.clone().requires_grad_(True)
            got = gmpo_surrogate(lc, la, lA, lm, llay, clip_low=0.2, clip_high=0.3)
            # every CP rank holds the full per-sequence value: its share of the token sum is the reference's
            (got.loss * lm).sum().backward()
            torch.testing.assert_close(got.loss, _local(want.loss.detach(), rank, order), rtol=1e-12, atol=1e-14)
            torch.testing.assert_close(lc.grad, _local(c.grad, rank, order), rtol=1e-12, atol=1e-14)


def check_cppo(rank: int, world: int) -> None:
    for order in CP_ORDERS:
        for (c, a, A, m), lay, (lc, la, lA, lm), llay in _cases(rank, order):
            want = cppo_mask(c, a, A, m, lay, **CPPO)
            q = sequence_quantile(want.mask.divergence, m, lay, BUDGET_QUANTILE)  # what the caller gathers under CP
            got = cppo_mask(lc, la, lA, lm, llay, quantile=q, **CPPO)
            valid = lm != 0
            assert torch.equal(got.mask.keep[valid], _local(want.mask.keep, rank, order)[valid])
            assert torch.equal(got.budget_bound[valid], _local(want.budget_bound, rank, order)[valid])
            assert torch.equal(got.first_exhausted, want.first_exhausted)
            assert (~want.mask.keep & (m != 0)).any()
            try:
                cppo_mask(lc, la, lA, lm, llay, **CPPO)
            except ValueError as e:
                assert "context-parallel" in str(e)
            else:
                raise AssertionError("a CP shard without the gathered quantile must be refused")


def check_cppo_loss(rank: int, world: int) -> None:
    """policy_objective='cppo' through ClippedPGLoss on a CP shard (the quantile from the gathered sequences): the
    loss summed over the ranks, this rank's gradient and the metrics equal the single-process loss's."""
    cfg = {"policy_objective": "cppo", "cppo_delta": 0.2, "cppo_w_min": 0.8, "cppo_delta_b": 0.02}
    cfg["reference_policy_kl_penalty"] = 0.0
    for order in CP_ORDERS:
        for (c, a, A, m), lay, (lc, la, lA, lm), llay in _cases(rank, order):
            counts = (float(lay.num_seqs), float(m.sum()))
            sm = torch.ones(lay.num_seqs, dtype=c.dtype)
            c = c.clone().requires_grad_(True)
            want, want_metrics = ClippedPGLoss(cfg).compute(LossInputs(c, a, a, None, A, m, sm, *counts), lay)
            want.backward()
            lc = lc.clone().requires_grad_(True)
            got, metrics = ClippedPGLoss(cfg).compute(LossInputs(lc, la, la, None, lA, lm, sm, *counts), llay)
            got.backward()
            total = got.detach().clone()
            dist.all_reduce(total)
            torch.testing.assert_close(total, want.detach(), rtol=1e-12, atol=1e-14)
            torch.testing.assert_close(lc.grad, _local(c.grad, rank, order), rtol=1e-12, atol=1e-14)
            for name in ("clip_fraction", "clip_fraction_high", "clip_fraction_low", "cppo_budget_bound_fraction"):
                assert metrics[name] == pytest.approx(want_metrics[name], rel=1e-12, abs=1e-15), name
            assert 0 < want_metrics["clip_fraction"] < 1


CHECKS = [("gmpo", check_gmpo), ("cppo", check_cppo), ("cppo_loss", check_cppo_loss)]


@pytest.mark.parametrize("name", [name for name, _ in CHECKS])
def test_objectives_under_cp(gloo_results, name):
    assert name in gloo_results, f"check {name} did not run"
    assert gloo_results[name] is None, gloo_results[name]
