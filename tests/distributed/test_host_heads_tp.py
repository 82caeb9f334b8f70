"""The host heads on 2 gloo ranks (spawned once): the plugin's head in NeMo-RL's and verl's places equals the host.

- NeMo-RL, TP = 2 with sequence parallelism (hidden rows sharded, gathered, dX reduce-scattered): the replacement of
  ``from_parallel_hidden_states_to_logprobs`` equals the model of NeMo-RL's own function run on the same two ranks
  (``tests/adapters/nemo_rl_head_host.py``) and a float64 single-process reference: log-probs, each rank's dX rows and
  dW shard; fp64 to 1e-12, fp32 to 1e-5; ``inference_only`` on both ranks.
- NeMo-RL's top-k / top-p training filter at TP = 2 with sequence parallelism: filtered and unfiltered log-probs and
  the gradients of a loss on both equal the float64 reference of test_filtered_head.py (1e-12).
- NeMo-RL's refusals lifted: CP = 2 in Megatron's load-balanced and the contiguous order, padded and packed (THD)
  layouts, CP-sharded and full labels: every CP rank gets the whole ``[B, S - 1]`` (packed: unpacked) log-probs of the
  single-process reference; with the loss divided by the CP size on each rank (NeMo-RL's normalisation), each rank's
  dX equals the reference's rows of its tokens and the dW summed over CP equals the reference's.
- verl, TP = 2: verl's own ``fused_output_processor`` (verl 0.9.1's ``model_forward_fused``, megatron-core's
  ``parallel_state`` groups on gloo; Megatron's ``gather_from_sequence_parallel_region`` allocates on CUDA, so on a
  CPU the module's reference to it is replaced by the same op written for gloo, ``_GatherSequenceParallel``: rows
  all-gathered, the gradient reduce-scattered) with the plugin's
  ``linear_cross_entropy`` installed in its place, with and without sequence parallelism, temperature 0.7: log-probs,
  entropy and the gradients of a loss on both equal the float64 reference (fp32 inputs: 1e-5); without sequence
  parallelism each rank's dX is its share, summing over TP to the reference's, as verl's kernel returns it.
"""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from adapters import nemo_rl_head_host as host

from nemo_is_plugin.adapters.nemo_rl.head import from_parallel_hidden_states_to_logprobs as plugin_nemo_rl
from nemo_is_plugin.apps.bench.problem import vocab_shard
from nemo_is_plugin.distributed.parallel.cp_sharding import shard_packed, shard_padded

WORLD = 2
GROUPS: dict[str, object] = {}
S, B, H, V = 8, 3, 16, 38


def setup_workers(rank: int, world_size: int) -> None:
    GROUPS["pair"] = dist.new_group(list(range(world_size)))


def _rel(a, b) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))


def _tensors(seed: int, *shapes, dtype=torch.float64, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g, dtype=torch.float64).mul(scale).to(dtype) for s in shapes]


def _reference(hidden, weight, labels, coef, temperature=1.0):
    """float64 autograd of ``log softmax(h W^T / T)`` at the labels rolled by one: (lp [B, S-1], dX, dW)."""
    h, w = hidden.double().requires_grad_(True), weight.double().requires_grad_(True)
    logp = torch.log_softmax(torch.einsum("sbh,vh->bsv", h, w) / temperature, dim=-1)
    lp = logp.gather(-1, labels.roll(-1, dims=-1)[..., None]).squeeze(-1)[:, :-1]
    (lp * coef.double()).sum().backward()
    return lp.detach(), h.grad, w.grad


def _nemo_rl_tp(dtype: torch.dtype, tol: float):
    def check(rank: int, world: int) -> None:
        group = GROUPS["pair"]
        hidden, weight = _tensors(1, (S, B, H), (V, H), dtype=dtype)
        (coef,) = _tensors(2, (B, S - 1), dtype=dtype)
        labels = torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(3))
        rows, per = slice(rank * S // 2, (rank + 1) * S // 2), V // 2
        out = {}
        for name, fn, kw in (
            ("host", host.from_parallel_hidden_states_to_logprobs, {"chunk_size": 3}),
            ("plugin", plugin_nemo_rl, {}),
        ):
            h = hidden[rows].clone().requires_grad_(True)
            w = vocab_shard(weight, rank, 2).clone().requires_grad_(True)
            lp = fn(h, w, None, labels, rank * per, (rank + 1) * per, group, **kw)
            (lp * coef).sum().backward()
            with torch.no_grad():
                lp_inf = fn(h, w, None, labels, rank * per, (rank + 1) * per, group, inference_only=True, **kw)
            out[name] = (lp.detach(), h.grad, w.grad, lp_inf)
        ref_lp, ref_dx, ref_dw = _reference(hidden, weight, labels, coef)
        for got, want in zip(out["plugin"], out["host"]):
            assert _rel(got, want) < tol
        assert _rel(out["plugin"][0], ref_lp) < tol and _rel(out["plugin"][3], ref_lp) < tol
        assert _rel(out["plugin"][1], ref_dx[rows]) < tol
        assert _rel(out["plugin"][2], vocab_shard(ref_dw, rank, 2)) < tol

    return check


def _nemo_rl_tp_filtered(top_k, top_p):
    """NeMo-RL's top-k / top-p training filter at TP = 2 with sequence parallelism: the rows of every token gathered
    over TP per chunk; filtered and unfiltered log-probs and the gradients of a loss on both equal the single-process
    float64 reference of tests/distributed/test_filtered_head.py."""

    def check(rank: int, world: int) -> None:
        from distributed.test_filtered_head import reference

        group = GROUPS["pair"]
        hidden, weight, coef = _tensors(10, (S, B, H), (V, H), (B, S - 1), scale=0.5)
        labels = torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(11))
        rows, per = slice(rank * S // 2, (rank + 1) * S // 2), V // 2
        h = hidden[rows].clone().requires_grad_(True)
        w = vocab_shard(weight, rank, 2).clone().requires_grad_(True)
        filtered, unfiltered = plugin_nemo_rl(
            h, w, None, labels, rank * per, (rank + 1) * per, group, top_k=top_k, top_p=top_p, temperature=0.8
        )
        loss = (torch.where(torch.isfinite(filtered), filtered, 0.0) * coef).sum() + (unfiltered * coef.flip(1)).sum()
        loss.backward()
        hr, wr = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        flat_h, flat_t = hr.permute(1, 0, 2)[:, :-1].reshape(-1, H), labels[:, 1:].reshape(-1)
        want_f, want_u = (r.reshape(B, S - 1) for r in reference(flat_h, wr, flat_t, top_k, top_p))
        want_loss = (torch.where(torch.isfinite(want_f), want_f, 0.0) * coef).sum() + (want_u * coef.flip(1)).sum()
        want_loss.backward()
        finite = torch.isfinite(want_f)
        assert torch.equal(torch.isfinite(filtered), finite) and 0 < int(finite.sum())
        assert _rel(filtered[finite], want_f[finite]) < 1e-12 and _rel(unfiltered, want_u) < 1e-12
        assert _rel(h.grad, hr.grad[rows]) < 1e-12
        assert _rel(w.grad, vocab_shard(wr.grad, rank, 2)) < 1e-12

    return check


def _nemo_rl_cp_padded(order: str, sharded_labels: bool):
    def check(rank: int, world: int) -> None:
        group = GROUPS["pair"]
        hidden, weight, coef = _tensors(4, (S, B, H), (V, H), (B, S - 1))
        labels = torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(5))
        h = shard_padded(hidden, rank, 2, order, dim=0).clone().requires_grad_(True)
        w = weight.clone().requires_grad_(True)
        given = shard_padded(labels, rank, 2, order, dim=1) if sharded_labels else labels
        lp = plugin_nemo_rl(h, w, None, given, 0, V, None, cp_group=group, cp_order=order)
        ((lp * coef).sum() / 2).backward()  # every CP rank's loss is the whole sequence's, divided by the CP size
        dw = w.grad.clone()
        dist.all_reduce(dw, group=group)
        ref_lp, ref_dx, ref_dw = _reference(hidden, weight, labels, coef)
        assert lp.shape == (B, S - 1) and _rel(lp, ref_lp) < 1e-12
        assert _rel(h.grad, shard_padded(ref_dx, rank, 2, order, dim=0)) < 1e-12
        assert _rel(dw, ref_dw) < 1e-12

    return check


def _nemo_rl_cp_packed(order: str):
    def check(rank: int, world: int) -> None:
        group = GROUPS["pair"]
        cu, max_len = [0, 8, 12, 24], 13  # every sequence a multiple of 2 CP = 4; the last one cut at max_len
        hidden, weight, coef = _tensors(6, (24, H), (V, H), (3, max_len - 1))
        labels = torch.randint(0, V, (1, 24), generator=torch.Generator().manual_seed(7))
        h = shard_packed(hidden, cu, rank, 2, order).unsqueeze(1).clone().requires_grad_(True)
        w = weight.clone().requires_grad_(True)
        given = shard_packed(labels[0], cu, rank, 2, order).unsqueeze(0)
        lp = plugin_nemo_rl(
            h, w, None, given, 0, V, None, cp_group=group, cp_order=order, cu_seqlens_padded=cu, unpacked_seqlen=max_len
        )
        ((lp * coef).sum() / 2).backward()
        dw = w.grad.clone()
        dist.all_reduce(dw, group=group)

        hr, wr = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        logp = torch.log_softmax(hr @ wr.t(), dim=-1)
        ref = torch.zeros(3, max_len - 1, dtype=torch.float64)
        for i, (a, b) in enumerate(zip(cu[:-1], cu[1:])):
            n = min(b - a - 1, max_len - 1)
            ref[i, :n] = logp[a : a + n].gather(-1, labels[0, a + 1 : a + 1 + n, None]).squeeze(-1)
        (ref * coef).sum().backward()
        assert lp.shape == ref.shape and _rel(lp, ref.detach()) < 1e-12
        assert _rel(h.grad[:, 0], shard_packed(hr.grad, cu, rank, 2, order)) < 1e-12
        assert _rel(dw, wr.grad) < 1e-12

    return check


class _GatherSequenceParallel(torch.autograd.Function):
    """Megatron's ``gather_from_sequence_parallel_region`` on gloo: all-gather dim 0, backward reduce-scatter."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group, size = group, dist.get_world_size(group)
        out = torch.empty((x.shape[0] * size, *x.shape[1:]), dtype=x.dtype)
        dist.all_gather_into_tensor(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        size = dist.get_world_size(ctx.group)
        out = torch.empty((grad.shape[0] // size, *grad.shape[1:]), dtype=grad.dtype)
        dist.reduce_scatter_tensor(out, grad.contiguous(), group=ctx.group)
        return out, None


def _verl_tp(sequence_parallel: bool):
    def check(rank: int, world: int) -> None:
        import verl.models.mcore.model_forward_fused as fused
        from megatron.core import parallel_state as ps

        from nemo_is_plugin.adapters.verl.head import install_head

        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        ps.initialize_model_parallel(tensor_model_parallel_size=2)
        gather = fused.gather_from_sequence_parallel_region
        if not torch.cuda.is_available():
            tp_group = ps.get_tensor_model_parallel_group()
            fused.gather_from_sequence_parallel_region = lambda x: _GatherSequenceParallel.apply(x, tp_group)
        try:
            install_head()
            n, temperature = 12, 0.7
            hidden, weight, c_lp, c_h = _tensors(8, (n, 1, H), (V, H), (n,), (n,), dtype=torch.float32)
            labels = torch.randint(0, V, (1, n), generator=torch.Generator().manual_seed(9))
            rows = slice(rank * n // 2, (rank + 1) * n // 2) if sequence_parallel else slice(None)
            h = hidden[rows].clone().requires_grad_(True)
            w = vocab_shard(weight, rank, 2).clone().requires_grad_(True)
            out = fused.fused_output_processor(
                hidden_states=h,
                output_layer=None,
                output_weight=w,
                labels=labels,
                context=fused.FusedOutputProcessorContext(temperature=temperature),
                config=SimpleNamespace(sequence_parallel=sequence_parallel),
            )
            ((out.log_probs * c_lp).sum() + (out.entropy * c_h).sum()).backward()
            dx = h.grad.clone()
            if not sequence_parallel:
                dist.all_reduce(dx, group=ps.get_tensor_model_parallel_group())  # verl's kernel: each rank's share
        finally:
            fused.gather_from_sequence_parallel_region = gather
            ps.destroy_model_parallel()
        hr, wr = hidden.double()[:, 0].requires_grad_(True), weight.double().requires_grad_(True)
        logp = torch.log_softmax(hr @ wr.t() / temperature, dim=-1)
        ref_lp, ref_h = logp.gather(-1, labels[0, :, None]).squeeze(-1), -(logp.exp() * logp).sum(-1)
        ((ref_lp * c_lp.double()).sum() + (ref_h * c_h.double()).sum()).backward()
        assert out.log_probs.shape == (n,) and out.entropy.shape == (n,) and out.log_probs.dtype == torch.float32
        assert (
            _rel(out.log_probs.detach(), ref_lp.detach()) < 1e-5 and _rel(out.entropy.detach(), ref_h.detach()) < 1e-5
        )
        assert _rel(dx[:, 0], hr.grad[rows]) < 1e-5
        assert _rel(w.grad, vocab_shard(wr.grad, rank, 2)) < 1e-5

    return check


CHECKS = [
    ("nemo_rl_tp2_sp_fp64", _nemo_rl_tp(torch.float64, 1e-12)),
    ("nemo_rl_tp2_sp_fp32", _nemo_rl_tp(torch.float32, 1e-5)),
    ("nemo_rl_tp2_sp_top_k", _nemo_rl_tp_filtered(6, None)),
    ("nemo_rl_tp2_sp_top_k_top_p", _nemo_rl_tp_filtered(12, 0.9)),
    *[
        (f"nemo_rl_cp2_padded_{order}_{'sharded' if sharded else 'full'}_labels", _nemo_rl_cp_padded(order, sharded))
        for order, sharded in itertools.product(("load_balanced", "contiguous"), (True, False))
    ],
    *[(f"nemo_rl_cp2_packed_{order}", _nemo_rl_cp_packed(order)) for order in ("load_balanced", "contiguous")],
]
try:
    import verl.models.mcore.model_forward_fused  # noqa: F401

    CHECKS += [("verl_tp2_sp", _verl_tp(True)), ("verl_tp2_no_sp", _verl_tp(False))]
except ImportError:  # verl is the verl extra; its checks are listed as skipped below
    pass


@pytest.mark.parametrize("name", [name for name, _ in CHECKS])
def test_host_head(gloo_results, name):
    assert gloo_results[name] is None, gloo_results[name]


def test_verl_checks_ran_where_verl_imports():
    pytest.importorskip("verl.models.mcore.model_forward_fused", reason="verl is the verl extra")
    assert {"verl_tp2_sp", "verl_tp2_no_sp"} <= {name for name, _ in CHECKS}
