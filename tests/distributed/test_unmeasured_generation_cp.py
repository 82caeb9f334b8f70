"""A non-finite generation log-prob under context parallelism (2 gloo ranks, spawned once): the weights it zeroes
reach the other shard (the cumulative prefix and the sequence sums cross CP ranks), padded and packed, load-balanced
and contiguous order, float64.

On each rank: ``compute_is_correction`` of its shard equals its shard of the single-process correction exactly, for
every IS level, with ``tis`` and batch normalisation (whose mean spans both shards), a clamped rule and the veto; and
``ClippedPGLoss.compute`` summed over the ranks equals the single-process loss, the rank's gradient its shard of the
single-process gradient.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from nemo_is_plugin.distributed.parallel.context_parallel import cp_layout
from nemo_is_plugin.distributed.parallel.cp_sharding import CP_ORDERS, shard_packed, shard_padded
from nemo_is_plugin.loss import ClippedPGLoss, LossInputs
from nemo_is_plugin.loss.correction import compute_is_correction
from nemo_is_plugin.loss.layout import TokenLayout
from nemo_is_plugin.loss.rejection import Rule

WORLD = 2
B, T = 3, 8  # T a multiple of 2 * WORLD (load-balanced chunks)
CU = [0, 8, 16, 24]
LEVELS = ("token", "sequence", "sequence_mean", "cumulative")


def _tensors(shape: tuple[int, ...], seed: int):
    g = torch.Generator().manual_seed(seed)
    prev = -(torch.rand(shape, generator=g, dtype=torch.float64) * 1.5 + 0.1)
    gen = (prev + 0.05 * torch.randn(shape, generator=g, dtype=torch.float64)).clamp(max=-1e-3)
    curr = (prev + 0.03 * torch.randn(shape, generator=g, dtype=torch.float64)).clamp(max=-1e-3)
    adv = torch.randn(shape, generator=g, dtype=torch.float64)
    return curr, prev, gen, adv, torch.ones(shape, dtype=torch.float64)


def _cases(rank: int, order: str):
    """(full tensors, full layout, shard function, CP layout): padded, then packed; a -inf generation log-prob at the
    second token of sequence 0 (its later tokens lie on both ranks in both orders), a NaN in sequence 1, padding."""
    curr, prev, gen, adv, mask = _tensors((B, T), 1)
    gen[0, 1], gen[1, 5], mask[2, 6:] = -math.inf, math.nan, 0.0
    yield (
        (curr, prev, gen, adv, mask),
        TokenLayout.padded(B, T),
        lambda x: shard_padded(x, rank, WORLD, order),
        (cp_layout(dist.group.WORLD, order, num_seqs=B, seq_len=T)),
    )
    curr, prev, gen, adv, mask = _tensors((CU[-1],), 2)
    gen[1], gen[13], mask[22:] = -math.inf, math.nan, 0.0
    yield (
        (curr, prev, gen, adv, mask),
        TokenLayout.packed(CU),
        lambda x: shard_packed(x, CU, rank, WORLD, order),
        (cp_layout(dist.group.WORLD, order, cu_seqlens_padded=CU)),
    )


OPTIONS = dict(apply_weights=True, truncation="tis", low=None, high=2.0, veto_threshold=0.5, batch_normalize=True)
RULES = (Rule("k1", "sequence_sum", -2.0, 2.0, 20.0),)


def check_weights(rank: int, world: int) -> None:
    for order in CP_ORDERS:
        for (_, p, g, _, m), lay, shard, llay in _cases(rank, order):
            for level in LEVELS:
                want = compute_is_correction(p, g, m, m, lay, level=level, nemo_rl_exact=False, rules=RULES, **OPTIONS)
                got = compute_is_correction(
                    shard(p),
                    shard(g),
                    shard(m),
                    shard(m),
                    llay,
                    level=level,
                    nemo_rl_exact=False,
                    rules=RULES,
                    **OPTIONS,
                )
                torch.testing.assert_close(got.weights, shard(want.weights), rtol=1e-14, atol=0)
                assert got.batch_norm_factor.item() == pytest.approx(want.batch_norm_factor.item(), rel=1e-14)
            zeroed = compute_is_correction(p, g, m, m, lay, level="cumulative", nemo_rl_exact=False, **OPTIONS)
            assert int((zeroed.weights == 0).sum()) >= 7  # the -inf's sequence from its token on, the NaN's


def check_loss(rank: int, world: int) -> None:
    cfg = ClippedPGLoss(
        {
            "use_importance_sampling_correction": True,
            "is_correction_level": "cumulative",
            "ratio_level": "cumulative",
            "reference_policy_kl_penalty": 0.0,
        }
    )
    for order in CP_ORDERS:
        for (c, p, g, a, m), lay, shard, llay in _cases(rank, order):
            counts = (float(lay.num_seqs), float(m.sum()))
            sm = torch.ones(lay.num_seqs, dtype=c.dtype)
            full = LossInputs(c.clone().requires_grad_(True), p, g, None, a, m, sm, *counts)
            want, want_metrics = cfg.compute(full, lay)
            want.backward()
            lc = shard(c).clone().requires_grad_(True)
            local = LossInputs(lc, shard(p), shard(g), None, shard(a), shard(m), sm, *counts)
            got, metrics = cfg.compute(local, llay)
            got.backward()
            total = got.detach().clone()
            dist.all_reduce(total)
            torch.testing.assert_close(total, want.detach(), rtol=1e-12, atol=1e-14)
            torch.testing.assert_close(lc.grad, shard(full.curr_logprobs.grad), rtol=1e-12, atol=1e-14)
            names = ("is_weight_mean", "is_weight_max", "is_rejected_fraction", "input_nonfinite_generation_fraction")
            for name in names:
                assert metrics[name] == pytest.approx(want_metrics[name], rel=1e-12, abs=1e-15), name
            assert want_metrics["is_rejected_fraction"] > 0 and math.isfinite(want.item())


CHECKS = [("weights", check_weights), ("loss", check_loss)]


@pytest.mark.parametrize("name", [name for name, _ in CHECKS])
def test_unmeasured_generation_under_cp(gloo_results, name):
    assert name in gloo_results, f"check {name} did not run"
    assert gloo_results[name] is None, gloo_results[name]
