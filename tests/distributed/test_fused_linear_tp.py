"""TP=2 (2 gloo ranks, spawned once): both fused log-prob paths with a vocab-sharded LM head equal the single-process
naive reference for every ratio level x IS level: loss, metrics, the full hidden-state gradient on every rank and each
rank's rows of the weight gradient (fp32: 1e-5 relative). Also sequence parallelism, entropy + temperature, bf16, and
the fused hidden-state loss ``fused_linear_pg_loss`` for every ratio level x IS level (single pass for the token and
cumulative ratios, two-pass for the sequence ones; each schedule proven by forbidding the other), with and without
sequence parallelism; and the policy objectives DPPO-TV, SAPO (single pass), GMPO and CPPO (two-pass).

Each rank rebuilds the same seeded problem, holds rows ``[r V/2, (r+1) V/2)`` of the LM head and passes the explicit
group; the reference runs on the full head in the same process.
"""

from __future__ import annotations

import contextlib
import itertools

import pytest
import torch
import torch.distributed as dist

import nemo_is_plugin.distributed.entry_points.fused_linear_loss as fused_loss_module
import nemo_is_plugin.distributed.head.fused_linear as fused_linear_module
from nemo_is_plugin import build_loss_fn
from nemo_is_plugin.apps.bench.paths import naive_logprobs
from nemo_is_plugin.apps.bench.problem import make_problem, vocab_shard
from nemo_is_plugin.distributed.entry_points.fused_linear_loss import fused_linear_pg_loss
from nemo_is_plugin.distributed.head.fused_linear import fused_linear_logprobs
from nemo_is_plugin.distributed.head.vocab_parallel import vocab_parallel_logprobs
from nemo_is_plugin.distributed.parallel.collectives import all_reduce_sum

from ._fused_cases import (
    IS_LEVELS,
    RATIO_LEVELS,
    SEQUENCE_OBJECTIVES,
    assert_metrics_close,
    level_config,
    objective_config,
    pg_problem,
    problem,
    rel_err,
    run,
)

WORLD = 2
CHUNK = 5
SINGLE_PASS_LEVELS = ("token", "cumulative", "cumulative_mean")  # fused_linear_pg_loss's single pass (padded layout)
GROUPS: dict[str, object] = {}


def setup_workers(rank: int, world_size: int) -> None:
    GROUPS["tp"] = dist.new_group(list(range(world_size)))


def _tp():
    group = GROUPS["tp"]
    return group, dist.get_rank(group), dist.get_world_size(group)


def fused_tp(h, w_shard, t):
    return fused_linear_logprobs(h, w_shard, t, GROUPS["tp"], chunk_size=CHUNK)


def from_logits_tp(h, w_shard, t):
    """Megatron's layout: the column-parallel LM head gives local logits; the hidden states' gradient is the sum of
    the ranks' partial gradients (copy_to_tensor_model_parallel_region's backward, written out here)."""
    h_tp = _CopyToTP.apply(h, GROUPS["tp"])
    return vocab_parallel_logprobs(h_tp @ w_shard.t(), t, GROUPS["tp"], chunk_size=CHUNK)


class _CopyToTP(torch.autograd.Function):
    """Identity forward, all-reduce SUM backward (Megatron's copy_to_tensor_model_parallel_region)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return all_reduce_sum(grad, ctx.group), None


def _level_check(ratio_level: str, is_level: str):
    def check(rank: int, world: int) -> None:
        _, tp_rank, tp_size = _tp()
        p, cfg = problem(vocab=38), level_config(ratio_level, is_level)
        ref_loss, ref_metrics, ref_dx, ref_dw = run(p, naive_logprobs, cfg)
        w_shard = vocab_shard(p.weight, tp_rank, tp_size)
        ref_dw_shard = vocab_shard(ref_dw, tp_rank, tp_size)
        for fn in (fused_tp, from_logits_tp):
            loss, metrics, dx, dw = run(p, fn, cfg, weight=w_shard)
            assert rel_err(loss, ref_loss) < 1e-5, fn.__name__
            assert_metrics_close(metrics, ref_metrics)
            assert rel_err(dx, ref_dx) < 1e-5, fn.__name__
            assert rel_err(dw, ref_dw_shard) < 1e-5, fn.__name__

    return check


def check_sequence_parallel(rank: int, world: int) -> None:
    """Hidden states sharded over TP along tokens: all-gathered forward, reduce-scattered gradient."""
    group, tp_rank, tp_size = _tp()
    p = make_problem(2, 9, 16, 38, seed=3)
    x, t = p.hidden.reshape(-1, 16), p.target.reshape(-1)  # 16 tokens
    coef = torch.randn(t.shape, generator=torch.Generator().manual_seed(4))
    n_local = x.shape[0] // tp_size
    x_local = x[tp_rank * n_local : (tp_rank + 1) * n_local].clone().requires_grad_(True)
    w_shard = vocab_shard(p.weight, tp_rank, tp_size).clone().requires_grad_(True)
    lp = fused_linear_logprobs(x_local, w_shard, t, group, chunk_size=CHUNK, sequence_parallel=True)
    (lp * coef).sum().backward()

    xr, wr = x.clone().requires_grad_(True), p.weight.clone().requires_grad_(True)
    ref = naive_logprobs(xr, wr, t)
    (ref * coef).sum().backward()
    assert rel_err(lp.detach(), ref.detach()) < 1e-5
    assert rel_err(x_local.grad, xr.grad[tp_rank * n_local : (tp_rank + 1) * n_local]) < 1e-5
    assert rel_err(w_shard.grad, vocab_shard(wr.grad, tp_rank, tp_size)) < 1e-5


def check_entropy_and_temperature(rank: int, world: int) -> None:
    group, tp_rank, tp_size = _tp()
    p = make_problem(2, 9, 16, 38, seed=5, logit_std=6.0)  # large logits: the shards' maxima differ
    g = torch.Generator().manual_seed(6)
    c_lp, c_h = torch.randn(p.target.shape, generator=g), torch.randn(p.target.shape, generator=g)
    h = p.hidden.clone().requires_grad_(True)
    w = vocab_shard(p.weight, tp_rank, tp_size).clone().requires_grad_(True)
    lp, ent = fused_linear_logprobs(h, w, p.target, group, chunk_size=CHUNK, temperature=0.8, with_entropy=True)
    ((lp * c_lp).sum() + (ent * c_h).sum()).backward()

    hr, wr = p.hidden.clone().requires_grad_(True), p.weight.clone().requires_grad_(True)
    logp = torch.log_softmax(hr @ wr.t() / 0.8, dim=-1)
    ref_lp, ref_h = logp.gather(-1, p.target.unsqueeze(-1)).squeeze(-1), -(logp.exp() * logp).sum(-1)
    ((ref_lp * c_lp).sum() + (ref_h * c_h).sum()).backward()
    assert (lp <= 0).all()
    assert rel_err(lp.detach(), ref_lp.detach()) < 1e-5 and rel_err(ent.detach(), ref_h.detach()) < 1e-5
    assert rel_err(h.grad, hr.grad) < 1e-5
    assert rel_err(w.grad, vocab_shard(wr.grad, tp_rank, tp_size)) < 1e-5


def check_bf16(rank: int, world: int) -> None:
    _, tp_rank, tp_size = _tp()
    p, cfg = problem(dtype=torch.bfloat16, seed=1, vocab=38), level_config("cumulative", "cumulative")
    ref_loss, ref_metrics, ref_dx, ref_dw = run(p, naive_logprobs, cfg, p.hidden.float(), p.weight.float())
    loss, metrics, dx, dw = run(p, fused_tp, cfg, weight=vocab_shard(p.weight, tp_rank, tp_size))
    assert dx.dtype == torch.bfloat16 and dw.dtype == torch.bfloat16
    assert rel_err(loss, ref_loss) < 1e-5
    assert_metrics_close(metrics, ref_metrics)
    assert rel_err(dx, ref_dx) < 1e-2 and rel_err(dw, vocab_shard(ref_dw, tp_rank, tp_size)) < 1e-2


@contextlib.contextmanager
def _forbidden_chunk_logits(module):
    """``module.chunk_logits`` raises inside the block: proves which schedule ran (both ranks take the same one, and
    the raise comes before any collective of that schedule)."""
    original = module.chunk_logits

    def boom(*args, **kwargs):
        raise AssertionError(f"{module.__name__}.chunk_logits must not run here")

    module.chunk_logits = boom
    try:
        yield
    finally:
        module.chunk_logits = original


def _pg_loss_tp(p, cfg, hidden, weight, **kwargs):
    """(loss, metrics, d hidden, d weight) of fused_linear_pg_loss with this rank's weight shard and the TP group."""
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    loss, metrics = fused_linear_pg_loss(
        build_loss_fn(cfg),
        h,
        w,
        p.target,
        p.data,
        p.global_valid_seqs,
        p.global_valid_toks,
        GROUPS["tp"],
        chunk_size=CHUNK,
        **kwargs,
    )
    loss.backward()
    return loss.detach(), metrics, h.grad, w.grad


def _assert_pg_parity(got, ref_loss, ref_metrics, ref_dx, ref_dw) -> None:
    loss, metrics, dx, dw = got
    # relative + absolute like the metrics: with mixed-sign advantages the loss is a cancelling sum (fp32 noise 1e-5)
    assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-5, abs=1e-7)
    assert_metrics_close(metrics, ref_metrics)
    assert rel_err(dx, ref_dx) < 1e-5, rel_err(dx, ref_dx)
    assert rel_err(dw, ref_dw) < 1e-5, rel_err(dw, ref_dw)
    assert ref_dx.abs().max() > 0 and ref_dw.abs().max() > 0


def _pg_level_check(ratio_level: str, is_level: str):
    """fused_linear_pg_loss under TP=2 equals the single-process naive path; the token and cumulative ratios run the
    single pass (the two-pass kernel is forbidden), the sequence levels the two-pass schedule (the single pass is
    forbidden)."""

    def check(rank: int, world: int) -> None:
        _, tp_rank, tp_size = _tp()
        p, cfg = pg_problem(vocab=38), level_config(ratio_level, is_level)
        ref_loss, ref_metrics, ref_dx, ref_dw = run(p, naive_logprobs, cfg)
        single = ratio_level in SINGLE_PASS_LEVELS
        with _forbidden_chunk_logits(fused_linear_module if single else fused_loss_module):
            got = _pg_loss_tp(p, cfg, p.hidden, vocab_shard(p.weight, tp_rank, tp_size), single_pass=single or None)
        _assert_pg_parity(got, ref_loss, ref_metrics, ref_dx, vocab_shard(ref_dw, tp_rank, tp_size))

    return check


def _pg_objective_check(name: str):
    """A policy objective through fused_linear_pg_loss under TP=2 equals the single-process naive path: the local
    objectives in the single pass, GMPO / CPPO in the two-pass schedule (each proven by forbidding the other)."""

    def check(rank: int, world: int) -> None:
        _, tp_rank, tp_size = _tp()
        p, cfg = pg_problem(vocab=38), objective_config(name)
        ref_loss, ref_metrics, ref_dx, ref_dw = run(p, naive_logprobs, cfg)
        single = name not in SEQUENCE_OBJECTIVES
        with _forbidden_chunk_logits(fused_linear_module if single else fused_loss_module):
            got = _pg_loss_tp(p, cfg, p.hidden, vocab_shard(p.weight, tp_rank, tp_size), single_pass=single or None)
        _assert_pg_parity(got, ref_loss, ref_metrics, ref_dx, vocab_shard(ref_dw, tp_rank, tp_size))

    return check


def _sp_problem():
    """pg_problem's recipe with 4 sequences (dim 0 splits over 2 ranks); the last one is masked by sample_mask."""
    base = make_problem(4, 9, 16, 38, seed=3)
    true_lp = naive_logprobs(base.hidden.double(), base.weight.double(), base.target)
    p = make_problem(4, 9, 16, 38, seed=3, base_logprobs=true_lp)
    p.data["advantages"] = torch.randn(p.data["advantages"].shape, generator=torch.Generator().manual_seed(103))
    p.data["rewards"] = torch.tensor([1.0, 0.0, 1.0, 1.0])
    return p


def _pg_sequence_parallel_check(ratio_level: str, is_level: str):
    """Hidden states sharded over TP along dim 0 (all-gathered forward, reduce-scattered dX)."""

    def check(rank: int, world: int) -> None:
        _, tp_rank, tp_size = _tp()
        p, cfg = _sp_problem(), level_config(ratio_level, is_level)
        ref_loss, ref_metrics, ref_dx, ref_dw = run(p, naive_logprobs, cfg)
        n_local = p.hidden.shape[0] // tp_size
        rows = slice(tp_rank * n_local, (tp_rank + 1) * n_local)
        single = ratio_level in SINGLE_PASS_LEVELS
        with _forbidden_chunk_logits(fused_linear_module if single else fused_loss_module):
            got = _pg_loss_tp(
                p,
                cfg,
                p.hidden[rows],
                vocab_shard(p.weight, tp_rank, tp_size),
                sequence_parallel=True,
                single_pass=single or None,
            )
        assert got[2].shape == (n_local,) + tuple(p.hidden.shape[1:])
        _assert_pg_parity(got, ref_loss, ref_metrics, ref_dx[rows], vocab_shard(ref_dw, tp_rank, tp_size))

    return check


CHECKS = (
    [(f"levels[{r}-{i}]", _level_check(r, i)) for r, i in itertools.product(RATIO_LEVELS, IS_LEVELS)]
    + [
        ("sequence_parallel", check_sequence_parallel),
        ("entropy_and_temperature", check_entropy_and_temperature),
        ("bf16", check_bf16),
    ]
    + [
        (f"pg_loss_{'single' if r in SINGLE_PASS_LEVELS else 'two'}_pass[{r}-{i}]", _pg_level_check(r, i))
        for r, i in itertools.product(RATIO_LEVELS, IS_LEVELS)
    ]
    + [
        ("pg_loss_sequence_parallel_single_pass[token-cumulative]", _pg_sequence_parallel_check("token", "cumulative")),
        (
            "pg_loss_sequence_parallel_single_pass[cumulative-cumulative]",
            _pg_sequence_parallel_check("cumulative", "cumulative"),
        ),
        ("pg_loss_sequence_parallel_two_pass[sequence-sequence]", _pg_sequence_parallel_check("sequence", "sequence")),
    ]
    + [(f"pg_loss_objective[{name}]", _pg_objective_check(name)) for name in ("dppo_tv", "sapo", "gmpo", "cppo")]
)


@pytest.mark.parametrize("name", [name for name, _ in CHECKS])
def test_fused_linear_tp2(gloo_results, name):
    assert gloo_results[name] is None, gloo_results[name]
