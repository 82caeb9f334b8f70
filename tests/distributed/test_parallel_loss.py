"""The LOGIT loss under megatron-core parallel layouts equals the single-process loss (4 gloo ranks, spawned once).

For every parallel layout (TP in {1, 2, 4}, CP in {1, 2}, TP x CP <= 4, the rest DP; and CP2 x PP2), every loss config
of ``_loss_cases.LOSS_CONFIGS`` (each ratio level, IS level, truncation type and aggregation), padded and packed
batches, load-balanced and contiguous CP order: each rank feeds its ``[B, S_local, V/TP]`` shard of the logits to
``LogitClippedPGLoss`` with the groups of ``ParallelGroups.from_parallel_state()`` and checks

- the loss summed over the CP group (identical on TP ranks) equals the single-process loss on the rank's micro-batch,
- the metrics equal the single-process metrics on every rank,
- the gradient w.r.t. its logits shard equals the matching block of the single-process gradient (0 on padding),

within ``_loss_cases.TOL`` / ``GRAD_RTOL`` (fp64 logits: 1e-10 relative; fp32: the noise floor of the single-process
loss itself, 2e-6 relative on loss and metrics and 5e-6 of max|g| on the gradient, see there). bf16 logits: loss and
metrics as fp32 (all the arithmetic after the per-chunk upcast is fp32), the gradient within bf16 rounding (2^-7 of its
largest entry). DP: the losses and metrics summed / min-maxed over DP ranks equal the single-process loss on the
concatenated batch. PP: the first stage receives the last stage's metrics; every policy objective
(``_loss_cases.OBJECTIVE_LOSS_CONFIGS``) on the last stage of CP2 x PP2 equals the single-process float64 loss.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from nemo_is_plugin.distributed.entry_points.logit_loss import LogitClippedPGLoss
from nemo_is_plugin.distributed.parallel.collectives import all_reduce_sum
from nemo_is_plugin.distributed.parallel.cp_sharding import CP_ORDERS, shard_packed, shard_padded
from nemo_is_plugin.distributed.parallel.data_parallel import all_reduce_metrics, global_valid_counts
from nemo_is_plugin.distributed.parallel.groups import ParallelGroups
from nemo_is_plugin.distributed.parallel.pipeline import broadcast_metrics_from_last_stage
from nemo_is_plugin.loss import ClippedPGLoss

from ._loss_cases import (
    LOSS_CONFIGS,
    OBJECTIVE_LOSS_CONFIGS,
    TOL,
    assert_metrics_close,
    assert_tensor_close,
    cu_seqlens,
    make_batch,
    pack,
    padded_lengths,
    reference,
)

WORLD = 4
VOCAB = 16
PS = {}  # megatron.core.parallel_state, imported once per worker
BF16_GRAD_RTOL = 2.0**-7


def setup_workers(rank: int, world_size: int) -> None:
    from megatron.core import parallel_state

    PS["ps"] = parallel_state


def _init(tp: int, cp: int, pp: int = 1) -> ParallelGroups:
    ps = PS["ps"]
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, context_parallel_size=cp
    )
    groups = ParallelGroups.from_parallel_state()
    assert groups.tp_size == tp and groups.cp_size == cp
    return groups


class Failures:
    """Collects assertion failures so that every rank finishes the same collectives before the check raises."""

    def __init__(self):
        self.items: list[str] = []

    def check(self, label: str, fn, *args, **kwargs) -> None:
        try:
            fn(*args, **kwargs)
        except AssertionError as exc:
            self.items.append(f"[{label}] {exc}")

    def raise_if_any(self) -> None:
        if self.items:
            raise AssertionError(f"{len(self.items)} failure(s):\n" + "\n".join(self.items[:5]))


def _local_logits(full: torch.Tensor, lengths, groups: ParallelGroups, kind: str, order: str, seed: int):
    """This rank's logits shard, the packed cu_seqlens (or None), and the map back to the full gradient layout."""
    cp, r = groups.cp_size, groups.cp_rank
    v = full.shape[-1] // groups.tp_size
    vocab = slice(groups.tp_rank * v, (groups.tp_rank + 1) * v)
    g = torch.Generator().manual_seed(seed)
    if kind == "padded":
        width = -(-full.shape[1] // (2 * cp)) * 2 * cp  # Megatron pads S to a multiple of 2*cp
        filler = torch.randn(full.shape[0], width - full.shape[1], full.shape[2], generator=g).to(full.dtype)
        widened = torch.cat([full, filler], dim=1)
        to_local = lambda t: shard_padded(t, r, cp, order)[..., vocab]  # noqa: E731
        return to_local(widened), None, lambda grad: to_local(torch.cat([grad, torch.zeros_like(filler)], dim=1))
    lp = padded_lengths(lengths, 2 * cp)
    cu = cu_seqlens(lp)
    to_local = lambda t, fill: shard_packed(pack(t, lp, fill), cu, r, cp, order)[..., vocab].unsqueeze(0)  # noqa: E731
    return to_local(full, 3.0), cu, lambda grad: to_local(grad, 0.0)


def _run_parallel(cfg, logits_local, data, counts, groups, order, cu):
    x = logits_local.detach().clone().requires_grad_(True)
    loss_fn = LogitClippedPGLoss(ClippedPGLoss(cfg), cp_order=order, chunk_size=5)
    loss, metrics = loss_fn(
        x,
        data,
        *counts,
        vocab_parallel_rank=groups.tp_rank,
        vocab_parallel_group=groups.tp,
        context_parallel_group=groups.cp,
        cu_seqlens_padded=cu,
    )
    loss.backward()
    return loss.detach(), metrics, x.grad


def _compare_layouts(groups: ParallelGroups, names, dtype: torch.dtype, failures: Failures, tag: str) -> None:
    """Every (config, kind, order) on this rank's DP micro-batch against the single-process reference."""
    dp_rank = PS["ps"].get_data_parallel_rank()
    full, data, lengths = make_batch(100 + dp_rank, dtype=dtype)
    counts = global_valid_counts(data["token_mask"], data["sample_mask"], groups.dp)
    orders = ("load_balanced", "contiguous") if groups.cp_size > 1 else ("load_balanced",)
    ref_dtype = torch.float32 if dtype == torch.bfloat16 else dtype
    tol = TOL[ref_dtype]
    for name, kind, order in itertools.product(names, ("padded", "packed"), orders):
        ctx = f"{tag} {name} {kind} {order}"
        local, cu, grad_to_local = _local_logits(full, lengths, groups, kind, order, seed=7)
        loss, metrics, grad = _run_parallel(LOSS_CONFIGS[name], local, data, counts, groups, order, cu)
        total = all_reduce_sum(loss, groups.cp)
        want_loss, want_metrics, want_grad = reference(LOSS_CONFIGS[name], full.to(ref_dtype), data, counts)
        want_local = grad_to_local(want_grad)
        failures.check(ctx + " loss", assert_tensor_close, total.to(ref_dtype), want_loss, ref_dtype)
        failures.check(ctx + " metrics", assert_metrics_close, metrics, want_metrics, context=ctx, **tol)
        if dtype == torch.bfloat16:
            rtol = BF16_GRAD_RTOL
            failures.check(
                ctx + " grad",
                torch.testing.assert_close,
                grad.float(),
                want_local.float(),
                rtol=rtol,
                atol=rtol * float(want_grad.abs().max()),
            )
        else:
            failures.check(ctx + " grad", assert_tensor_close, grad, want_local, dtype, grad=True)


def _layout_check(tp: int, cp: int, names=tuple(LOSS_CONFIGS), dtype=torch.float32):
    def check(rank: int, world: int) -> None:
        groups = _init(tp, cp)
        failures = Failures()
        _compare_layouts(groups, names, dtype, failures, f"tp{tp} cp{cp} {dtype}")
        failures.raise_if_any()

    return check


def check_dp_sums_to_the_global_batch(rank: int, world: int) -> None:
    """TP1 x CP2 x DP2: losses and metrics added over CP and DP ranks = the single-process concatenated batch."""
    groups = _init(1, 2)
    dp_size, dp_rank = PS["ps"].get_data_parallel_world_size(), PS["ps"].get_data_parallel_rank()
    assert dp_size == 2
    batches = [make_batch(200 + k) for k in range(dp_size)]
    full, data, lengths = batches[dp_rank]
    counts = global_valid_counts(data["token_mask"], data["sample_mask"], groups.dp)
    cat_logits = torch.cat([b[0] for b in batches])
    cat_data = {k: torch.cat([b[1][k] for b in batches]) for k in data}
    failures = Failures()
    for name in ("nemo_rl_default", "ctpo_cumulative_is", "seq_mis_veto"):
        local, cu, _ = _local_logits(full, lengths, groups, "padded", "load_balanced", seed=3)
        loss, metrics, _ = _run_parallel(LOSS_CONFIGS[name], local, data, counts, groups, "load_balanced", cu)
        total = all_reduce_sum(all_reduce_sum(loss, groups.cp), groups.dp)
        reduced = all_reduce_metrics(metrics, groups.dp)
        want_loss, want_metrics, _ = reference(LOSS_CONFIGS[name], cat_logits, cat_data)
        failures.check(name + " loss", assert_tensor_close, total, want_loss, torch.float32)
        failures.check(
            name + " metrics", assert_metrics_close, reduced, want_metrics, context=name, **TOL[torch.float32]
        )
    failures.raise_if_any()


def check_pp_metrics_broadcast(rank: int, world: int) -> None:
    """CP2 x PP2: the loss runs on the last stage; the first stage gets the same metrics by broadcast."""
    groups = _init(1, 2, pp=2)
    assert groups.pp is not None
    full, data, lengths = make_batch(300)
    counts = global_valid_counts(data["token_mask"], data["sample_mask"], None)
    metrics = None
    if groups.pp_is_last:
        local, cu, _ = _local_logits(full, lengths, groups, "packed", "load_balanced", seed=5)
        _, metrics, _ = _run_parallel(
            LOSS_CONFIGS["ctpo_cumulative_is"], local, data, counts, groups, "load_balanced", cu
        )
    got = broadcast_metrics_from_last_stage(metrics, groups)
    _, want, _ = reference(LOSS_CONFIGS["ctpo_cumulative_is"], full, data, counts)
    assert_metrics_close(got, want, context=f"pp last={groups.pp_is_last}", **TOL[torch.float32])


def check_pp_last_stage_objectives(rank: int, world: int) -> None:
    """CP2 x PP2, float64 logits: every policy objective computed on the last stage (padded and packed, both CP
    orders) equals the single-process float64 loss (summed over CP), gradient and metrics; the first stage receives
    the same metrics."""
    groups = _init(1, 2, pp=2)
    full, data, lengths = make_batch(300, dtype=torch.float64)
    counts = global_valid_counts(data["token_mask"], data["sample_mask"], None)
    failures = Failures()
    for name, kind, order in itertools.product(OBJECTIVE_LOSS_CONFIGS, ("padded", "packed"), CP_ORDERS):
        cfg, ctx = OBJECTIVE_LOSS_CONFIGS[name], f"pp2 cp2 {name} {kind} {order} last={groups.pp_is_last}"
        want_loss, want_metrics, want_grad = reference(cfg, full, data, counts)
        metrics = None
        if groups.pp_is_last:
            local, cu, grad_to_local = _local_logits(full, lengths, groups, kind, order, seed=5)
            loss, metrics, grad = _run_parallel(cfg, local, data, counts, groups, order, cu)
            total = all_reduce_sum(loss, groups.cp)
            failures.check(ctx + " loss", assert_tensor_close, total, want_loss, torch.float64)
            failures.check(ctx + " grad", assert_tensor_close, grad, grad_to_local(want_grad), torch.float64, True)
        got = broadcast_metrics_from_last_stage(metrics, groups)
        failures.check(ctx + " metrics", assert_metrics_close, got, want_metrics, context=ctx, **TOL[torch.float64])
    failures.raise_if_any()


def check_groups_from_parallel_state(rank: int, world: int) -> None:
    groups = _init(2, 2)
    ps = PS["ps"]
    assert groups.tp_rank == ps.get_tensor_model_parallel_rank()
    assert groups.cp_rank == ps.get_context_parallel_rank()
    assert groups.dp is None and groups.pp is None and groups.pp_is_last  # groups of one are None: no collectives
    ps.destroy_model_parallel()
    assert ParallelGroups.from_parallel_state() == ParallelGroups()


CHECKS = [
    ("groups_from_parallel_state", check_groups_from_parallel_state),
    ("tp1_cp1_dp4", _layout_check(1, 1)),
    ("tp2_cp1_dp2", _layout_check(2, 1)),
    ("tp4_cp1", _layout_check(4, 1)),
    ("tp1_cp2_dp2", _layout_check(1, 2)),
    ("tp2_cp2", _layout_check(2, 2)),
    ("tp2_cp2_fp64", _layout_check(2, 2, dtype=torch.float64)),
    (
        "tp2_cp2_bf16",
        _layout_check(2, 2, names=("nemo_rl_default", "ctpo_cumulative_is", "gspo_nemo_rl"), dtype=torch.bfloat16),
    ),
    ("dp_sums_to_the_global_batch", check_dp_sums_to_the_global_batch),
    ("pp_metrics_broadcast", check_pp_metrics_broadcast),
    ("pp_last_stage_objectives", check_pp_last_stage_objectives),
]


@pytest.mark.parametrize("name", [name for name, _ in CHECKS])
def test_parallel_loss(gloo_results, name):
    assert name in gloo_results, f"check {name} did not run"
    assert gloo_results[name] is None, gloo_results[name]
