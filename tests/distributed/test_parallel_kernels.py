"""Multi-process (4 gloo ranks, spawned once) checks of the collectives, CP sharding, the CP layout and TP log-probs.

Every check compares the parallel result on each rank with the single-process result on the full tensors, which each
rank recomputes from the same seeded data: values, and gradients of a loss whose CP-summed value is the
single-process loss. CP uses groups of 2 and 4, TP groups of 2 and 4, built with ``dist.new_group`` (explicit groups;
the megatron ``parallel_state`` path is covered in ``test_parallel_loss.py``).
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist

from nemo_is_plugin.distributed.head.vocab_parallel import vocab_parallel_logprobs
from nemo_is_plugin.distributed.parallel.collectives import all_gather, all_reduce_max, all_reduce_min, all_reduce_sum
from nemo_is_plugin.distributed.parallel.context_parallel import CPTokenLayout, cp_layout
from nemo_is_plugin.distributed.parallel.cp_sharding import (
    gather_packed,
    gather_padded,
    local_cu_seqlens,
    padded_local_positions,
    shard_packed,
    shard_padded,
)
from nemo_is_plugin.distributed.parallel.groups import group_rank
from nemo_is_plugin.loss.layout import TokenLayout

WORLD = 4
GROUPS: dict[str, object] = {}  # filled in each worker by setup_workers
B, S = 3, 16  # padded batch; S is a multiple of 2*cp for cp in {2, 4}
PACKED_LENGTHS = [8, 16, 0, 24]  # padded lengths, multiples of 8 = 2*4; one empty sequence
ORDERS = ("load_balanced", "contiguous")


def setup_workers(rank: int, world_size: int) -> None:
    """Create the groups every check uses (same calls, same order, on every rank)."""
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    GROUPS["pair"] = pairs[rank // 2]  # CP=2 or TP=2
    GROUPS["all"] = dist.new_group(list(range(world_size)))  # CP=4 or TP=4


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------------------------------------------------- collectives
def check_collectives(rank: int, world: int) -> None:
    group = GROUPS["all"]
    coef = torch.arange(4.0) + 10 * rank  # a different loss on every rank
    x = (torch.arange(4.0) + rank).requires_grad_(True)
    s = all_reduce_sum(x, group)
    (s * coef).sum().backward()
    # dL/dx_r = sum_k coef_k for L = sum_k L_k
    all_coef = torch.stack([torch.arange(4.0) + 10 * k for k in range(world)])
    torch.testing.assert_close(s.detach(), sum(torch.arange(4.0) + k for k in range(world)))
    torch.testing.assert_close(x.grad, all_coef.sum(0))

    y = (torch.arange(3.0) * (rank + 1)).requires_grad_(True)
    gathered = all_gather(y, group)
    c = torch.arange(3.0 * world) * (rank + 1)
    (gathered * c).sum().backward()
    torch.testing.assert_close(gathered.detach(), torch.cat([torch.arange(3.0) * (k + 1) for k in range(world)]))
    c_all = torch.stack([torch.arange(3.0 * world) * (k + 1) for k in range(world)]).sum(0)
    torch.testing.assert_close(y.grad, c_all[3 * rank : 3 * rank + 3])

    v = torch.tensor([float(rank), -float(rank)])
    assert all_reduce_max(v, group).tolist() == [world - 1.0, 0.0]
    assert all_reduce_min(v, group).tolist() == [0.0, -(world - 1.0)]
    assert all_reduce_sum(v, None) is v  # None = no reduction


# ------------------------------------------------------------------------------------------------------------- sharding
def _cp(name: str):
    group = GROUPS[name]
    return group, group_rank(group), dist.get_world_size(group)


def check_sharding_round_trip(rank: int, world: int) -> None:
    x = torch.randn(B, S, 2, generator=_gen(1))
    packed = torch.randn(sum(PACKED_LENGTHS), generator=_gen(2))
    cu = torch.tensor([0] + list(itertools.accumulate(PACKED_LENGTHS)))
    for name, order in itertools.product(("pair", "all"), ORDERS):
        group, r, size = _cp(name)
        local = shard_padded(x, r, size, order)
        assert local.shape == (B, S // size, 2)
        torch.testing.assert_close(gather_padded(local, group, order), x, rtol=0, atol=0)
        local_p = shard_packed(packed, cu, r, size, order)
        assert local_p.shape == (sum(PACKED_LENGTHS) // size,)
        torch.testing.assert_close(gather_packed(local_p, cu, group, order), packed, rtol=0, atol=0)
        assert local_cu_seqlens(cu, size).tolist() == [c // size for c in cu.tolist()]
    # Megatron's load-balanced order, by hand: S=8, cp=2 -> chunks of 2; rank 0 holds 0 and 3, rank 1 holds 1 and 2
    assert padded_local_positions(8, 0, 2).tolist() == [0, 1, 6, 7]
    assert padded_local_positions(8, 1, 2).tolist() == [2, 3, 4, 5]
    assert padded_local_positions(8, 1, 2, "contiguous").tolist() == [4, 5, 6, 7]


# ------------------------------------------------------------------------------------------------------------ CP layout
def _layout_objective(layout: TokenLayout, x, w_prefix, w_seq, share):
    """A loss touching every reduction: sum(w * prefix^2) + share(sum_i v_i seq_sum_i^2) + prefix through to_tokens."""
    pre = layout.prefix_sum(x)
    seq = layout.seq_sum(x * x)
    return (w_prefix * pre * pre).sum() + share((w_seq * seq).sum()) + (layout.to_tokens(seq) * x).sum() * 0.1


def _check_layout_case(kind: str, name: str, order: str) -> None:
    group, r, size = _cp(name)
    if kind == "padded":
        full = TokenLayout.padded(B, S)
        x_full = torch.randn(B, S, generator=_gen(3), dtype=torch.float32)
        w_full = torch.randn(B, S, generator=_gen(4))
        local = cp_layout(group, order, num_seqs=B, seq_len=S)
        shard = lambda t: shard_padded(t, r, size, order)  # noqa: E731
    else:
        cu = torch.tensor([0] + list(itertools.accumulate(PACKED_LENGTHS)))
        full = TokenLayout.packed(cu)
        x_full = torch.randn(int(cu[-1]), generator=_gen(5))
        w_full = torch.randn(int(cu[-1]), generator=_gen(6))
        local = cp_layout(group, order, cu_seqlens_padded=cu)
        shard = lambda t: shard_packed(t, cu, r, size, order)  # noqa: E731
    assert isinstance(local, CPTokenLayout)
    w_seq = torch.randn(full.num_seqs, generator=_gen(7))

    xf = x_full.clone().requires_grad_(True)
    _layout_objective(full, xf, w_full, w_seq, lambda t: t).backward()
    xl = shard(x_full).clone().requires_grad_(True)
    _layout_objective(local, xl, shard(w_full), w_seq, local.replicated_share).backward()

    with torch.no_grad():
        torch.testing.assert_close(local.position, shard(full.position))
        torch.testing.assert_close(local.seq_index, shard(full.seq_index))
        torch.testing.assert_close(local.prefix_sum(xl), shard(full.prefix_sum(x_full)), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(local.seq_sum(xl), full.seq_sum(x_full), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(local.seq_max(xl), full.seq_max(x_full))
        torch.testing.assert_close(local.seq_min(xl), full.seq_min(x_full))
        # the per-rank losses add up to the single-process loss
        l_local = _layout_objective(local, xl, shard(w_full), w_seq, local.replicated_share)
        l_full = _layout_objective(full, x_full, w_full, w_seq, lambda t: t)
        torch.testing.assert_close(all_reduce_sum(l_local, group), l_full, rtol=1e-6, atol=1e-6)
    # the gradient w.r.t. the local tokens is the shard of the single-process gradient
    torch.testing.assert_close(xl.grad, shard(xf.grad), rtol=1e-6, atol=1e-6)
    # the 1-based count of earlier-or-equal tokens is exact (position-adaptive clipping reads it)
    ones = torch.ones_like(xl, dtype=torch.float64)
    torch.testing.assert_close(local.prefix_sum(ones), (local.position + 1).double())


def check_cp_layout(rank: int, world: int) -> None:
    for kind, name, order in itertools.product(("padded", "packed"), ("pair", "all"), ORDERS):
        _check_layout_case(kind, name, order)


def check_cp_layout_empty_sequence_extremes(rank: int, world: int) -> None:
    """A sequence without tokens gives -inf / +inf max / min and 0 sums on every rank."""
    group, r, size = _cp("all")
    cu = torch.tensor([0] + list(itertools.accumulate(PACKED_LENGTHS)))
    local = cp_layout(group, "load_balanced", cu_seqlens_padded=cu)
    x = torch.ones(int(cu[-1]) // size)
    assert local.seq_max(x)[2].item() == float("-inf") and local.seq_min(x)[2].item() == float("inf")
    assert local.seq_sum(x).tolist() == [float(n) for n in PACKED_LENGTHS]


# ------------------------------------------------------------------------------------------------------ TP log-probs
def _check_tp_logprob(name: str, dtype: torch.dtype, tol: dict) -> None:
    group, r, size = _cp(name)
    V = 24
    logits = (torch.randn(B, 5, V, generator=_gen(8)) * 4).to(dtype)
    target = torch.randint(0, V, (B, 5), generator=_gen(9))
    w, u = torch.randn(B, 5, generator=_gen(10)), torch.randn(B, 5, generator=_gen(11))

    ref = logits.double().requires_grad_(True)
    logp = torch.log_softmax(ref, -1)
    ref_lp, ref_ent = logp.gather(-1, target.unsqueeze(-1)).squeeze(-1), -(logp.exp() * logp).sum(-1)
    ((ref_lp * w).sum() + (ref_ent * u).sum()).backward()

    sl = slice(r * V // size, (r + 1) * V // size)
    x = logits[..., sl].clone().requires_grad_(True)
    lp, ent = vocab_parallel_logprobs(x, target, group, chunk_size=4, with_entropy=True)
    ((lp * w).sum() + (ent * u).sum()).backward()  # replicated over TP: each rank differentiates the same loss

    torch.testing.assert_close(lp.double(), ref_lp.detach(), **tol)
    torch.testing.assert_close(ent.double(), ref_ent.detach(), **tol)
    assert x.grad.dtype == dtype
    grad_tol = tol if dtype == torch.float32 else {"rtol": 1e-2, "atol": 2e-3}  # the gradient is rounded to bf16
    torch.testing.assert_close(x.grad.double(), ref.grad[..., sl], **grad_tol)


def check_tp_logprobs_fp32(rank: int, world: int) -> None:
    for name in ("pair", "all"):
        _check_tp_logprob(name, torch.float32, {"rtol": 1e-6, "atol": 1e-6})


def check_tp_logprobs_bf16(rank: int, world: int) -> None:
    # the logits are bf16 values; everything after the per-chunk upcast is fp32, so values match the fp64 reference
    # on the same bf16 numbers to fp32 accuracy
    for name in ("pair", "all"):
        _check_tp_logprob(name, torch.bfloat16, {"rtol": 1e-5, "atol": 1e-5})


CHECKS = [
    ("collectives", check_collectives),
    ("sharding_round_trip", check_sharding_round_trip),
    ("cp_layout", check_cp_layout),
    ("cp_layout_empty_sequence", check_cp_layout_empty_sequence_extremes),
    ("tp_logprobs_fp32", check_tp_logprobs_fp32),
    ("tp_logprobs_bf16", check_tp_logprobs_bf16),
]


@pytest.mark.parametrize("name", [name for name, _ in CHECKS])
def test_parallel_kernels(gloo_results, name):
    assert name in gloo_results, f"check {name} did not run"
    assert gloo_results[name] is None, gloo_results[name]
