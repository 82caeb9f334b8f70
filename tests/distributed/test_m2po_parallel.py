"""policy_objective='m2po' under parallelism (2 gloo ranks, spawned once): its second-moment statistic spans every
process holding part of the batch, so the clip bounds, the loss summed over the ranks, each rank's gradient and the
additive metrics equal the single-process ones (float64, to 1e-12).

- CP=2: ``ClippedPGLoss.compute`` on each rank's shard (padded and packed, load-balanced and contiguous order), with
  token-level TIS weights composed;
- DP=2: each rank holds half the sequences; ``distributed.parallel.data_parallel.with_data_parallel`` (what the entry
  points do with their ``dp_group``), and the LOGIT entry point and the fused hidden-state
  loss given the group; without it each rank's bounds are its own micro-batch's (the authors' per-micro-batch scope),
  which differ here: the reduction is what makes them equal.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from nemo_is_plugin.distributed.entry_points.fused_linear_loss import fused_linear_pg_loss
from nemo_is_plugin.distributed.entry_points.logit_loss import LogitClippedPGLoss
from nemo_is_plugin.distributed.parallel.context_parallel import cp_layout
from nemo_is_plugin.distributed.parallel.cp_sharding import CP_ORDERS, shard_packed, shard_padded
from nemo_is_plugin.distributed.parallel.data_parallel import with_data_parallel
from nemo_is_plugin.loss import ClippedPGLoss, LossInputs
from nemo_is_plugin.loss.layout import TokenLayout

WORLD = 2
F64 = torch.float64
B, T = 4, 16  # T a multiple of 2 * WORLD (load-balanced chunks)
CU = [0, 8, 16, 28, 32]  # packed sequences of 8, 8, 12 and 4 tokens (multiples of 2 * WORLD, as CP pads them)
CONFIG = {
    "policy_objective": "m2po",
    "m2po_budget": 0.01,
    "reference_policy_kl_penalty": 0.0,
    "use_importance_sampling_correction": True,
    "truncated_importance_sampling_type": "tis",
    "truncated_importance_sampling_ratio": 1.2,
}
ADDITIVE = ("m2po_harmful_fraction", "m2po_harmful_log_ratio_sq", "m2po_capped_log_ratio_sq", "clip_fraction", "loss")
BOUNDS = ("m2po_clip_low_min", "m2po_clip_low_max", "m2po_clip_high_min", "m2po_clip_high_max")


def _tensors(shape: tuple[int, ...], seq_of: torch.Tensor, seed: int):
    """curr, prev, generation, per-sequence advantages broadcast to tokens, token mask; float64."""
    g = torch.Generator().manual_seed(seed)
    prev = torch.log(torch.rand(shape, generator=g, dtype=F64) * 0.9 + 0.05)
    curr = (prev + 0.3 * torch.randn(shape, generator=g, dtype=F64)).clamp(max=-1e-4)
    gen = (prev + 0.1 * torch.randn(shape, generator=g, dtype=F64)).clamp(max=-1e-4)
    adv = torch.tensor([1.2, -0.8, 0.5, -1.5], dtype=F64)[seq_of]
    mask = torch.ones(shape, dtype=F64)
    return curr, prev, gen, adv, mask


def _compute(cfg, curr, prev, gen, adv, mask, num_seqs, layout, counts):
    c = curr.clone().requires_grad_(True)
    inputs = LossInputs(c, prev, gen, None, adv, mask, torch.ones(num_seqs, dtype=F64), *counts)
    loss, metrics = ClippedPGLoss(cfg).compute(inputs, layout)
    loss.backward()
    return loss.detach(), c.grad, metrics


def _all_sum(x: torch.Tensor) -> torch.Tensor:
    x = x.clone()
    dist.all_reduce(x)
    return x


def _assert_metrics(got: dict, want: dict, summed: bool) -> None:
    for name in BOUNDS:
        assert got[name] == pytest.approx(want[name], rel=1e-12, abs=1e-15), name
    assert want["m2po_clip_high_max"] < 1.0  # the budget binds
    for name in ADDITIVE:
        value = torch.tensor(got[name], dtype=F64)
        value = _all_sum(value) if summed else value
        assert float(value) == pytest.approx(want[name], rel=1e-12, abs=1e-15), name


def check_cp2(rank: int, world: int) -> None:
    for order in CP_ORDERS:
        padded = _tensors((B, T), torch.arange(B)[:, None].expand(B, T), seed=1)
        padded[4][1, 12:] = 0  # padding
        seq = torch.repeat_interleave(torch.arange(len(CU) - 1), torch.tensor([b - a for a, b in zip(CU[:-1], CU[1:])]))
        packed = _tensors((CU[-1],), seq, seed=2)
        packed[4][9] = 0  # an interior masked token
        cases = (
            (
                padded,
                TokenLayout.padded(B, T),
                lambda x, o=order: shard_padded(x, rank, WORLD, o),
                dict(num_seqs=B, seq_len=T),
            ),
            (
                packed,
                TokenLayout.packed(CU),
                lambda x, o=order: shard_packed(x, CU, rank, WORLD, o),
                dict(cu_seqlens_padded=CU),
            ),
        )
        for full, layout, shard, where in cases:
            counts = (float(B), float(full[4].sum()))
            want, want_grad, want_metrics = _compute(CONFIG, *full, B, layout, counts)
            local = cp_layout(dist.group.WORLD, order, **where)
            got, grad, metrics = _compute(CONFIG, *(shard(x) for x in full), B, local, counts)
            torch.testing.assert_close(_all_sum(got), want, rtol=1e-12, atol=1e-15)
            torch.testing.assert_close(grad, shard(want_grad), rtol=1e-12, atol=1e-15)
            _assert_metrics(metrics, want_metrics, summed=False)  # CP ranks report the full-batch metrics


def _dp_batch(rank: int):
    full = _tensors((B, T), torch.arange(B)[:, None].expand(B, T), seed=3)
    full[4][2, 10:] = 0
    rows = slice(rank * B // WORLD, (rank + 1) * B // WORLD)
    return full, tuple(x[rows] for x in full), rows


def check_dp2(rank: int, world: int) -> None:
    full, mine, rows = _dp_batch(rank)
    counts = (float(B), float(full[4].sum()))  # the global normalisers
    want, want_grad, want_metrics = _compute(CONFIG, *full, B, TokenLayout.padded(B, T), counts)
    layout = with_data_parallel(TokenLayout.padded(B // WORLD, T), dist.group.WORLD)
    got, grad, metrics = _compute(CONFIG, *mine, B // WORLD, layout, counts)
    torch.testing.assert_close(_all_sum(got), want, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(grad, want_grad[rows], rtol=1e-12, atol=1e-15)
    _assert_metrics(metrics, want_metrics, summed=True)
    # without the group, each rank's bounds are its own micro-batch's, and differ from the batch's here
    _, _, alone = _compute(CONFIG, *mine, B // WORLD, TokenLayout.padded(B // WORLD, T), counts)
    differ = torch.tensor(float(alone["m2po_clip_high_max"] != want_metrics["m2po_clip_high_max"]))
    assert float(_all_sum(differ)) >= 1


def _logit_data(full, rows, vocab: int, seed: int):
    """A NeMo-RL LOGIT batch ([B, S] data, S = T + 1) and logits whose log-probs of the sampled tokens are ``curr``'s
    order of magnitude; ``rows`` of it."""
    curr, prev, gen, adv, mask = full
    g = torch.Generator().manual_seed(seed)
    logits = 2.0 * torch.randn(B, T + 1, vocab, generator=g, dtype=F64)
    ids = torch.randint(0, vocab, (B, T + 1), generator=g)
    pad = lambda x: torch.cat([torch.zeros(B, 1, dtype=F64), x], dim=1)  # noqa: E731  (position 0 predicts nothing)
    data = {
        "input_ids": ids,
        "token_mask": pad(mask),
        "advantages": pad(adv),
        "prev_logprobs": pad(prev - 1.0),
        "generation_logprobs": pad(gen - 1.0),
        "sample_mask": torch.ones(B, dtype=F64),
    }
    return logits[rows], {k: v[rows] for k, v in data.items()}, logits, data


def check_dp2_entry_points(rank: int, world: int) -> None:
    """The LOGIT entry point and the fused hidden-state loss, each given the group as ``dp_group``."""
    full, _, rows = _dp_batch(rank)
    counts = (float(B), float(full[4].sum()))
    loss_fn = ClippedPGLoss(CONFIG)
    logits, data, all_logits, all_data = _logit_data(full, rows, vocab=12, seed=5)
    want, want_metrics = LogitClippedPGLoss(loss_fn)(all_logits, all_data, *counts)
    got, metrics = LogitClippedPGLoss(loss_fn)(logits, data, *counts, dp_group=dist.group.WORLD)
    torch.testing.assert_close(_all_sum(got.detach()), want.detach(), rtol=1e-12, atol=1e-15)
    _assert_metrics(metrics, want_metrics, summed=True)
    g = torch.Generator().manual_seed(6)
    hidden = torch.randn(B, T, 8, generator=g, dtype=F64)
    weight = torch.randn(12, 8, generator=g, dtype=F64)
    target = all_data["input_ids"][:, 1:]
    want, want_metrics = fused_linear_pg_loss(loss_fn, hidden, weight, target, all_data, *counts)
    got, metrics = fused_linear_pg_loss(
        loss_fn, hidden[rows], weight, target[rows], data, *counts, dp_group=dist.group.WORLD
    )
    torch.testing.assert_close(_all_sum(got.detach()), want.detach(), rtol=1e-12, atol=1e-15)
    _assert_metrics(metrics, want_metrics, summed=True)


CHECKS = [("cp2", check_cp2), ("dp2", check_dp2), ("dp2_entry_points", check_dp2_entry_points)]


@pytest.mark.parametrize("name", [name for name, _ in CHECKS])
def test_m2po_statistic_spans_the_parallel_groups(gloo_results, name):
    assert name in gloo_results, f"check {name} did not run"
    assert gloo_results[name] is None, gloo_results[name]
