"""The distributed entry points, single process, under the CPU device guard (helpers/device_guard.py): the LOGIT loss
(padded and packed), the context-parallel layout, the vocab-parallel log-probs, the fused hidden-state log-probs
(torch and Triton backends) and the fused loss (single and two pass). Each run under the guard must equal the plain
run bit for bit; the host synchronisations of layout construction and of the loss call are counted.

Not counted here: the syncs inside the chunk loops of the log-prob kernels (their own tests' business).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.device_guard import assert_identical, count_host_syncs, device_guard, run_guarded_and_plain

from nemo_is_plugin import build_loss_fn
from nemo_is_plugin.apps.bench.problem import make_problem
from nemo_is_plugin.distributed.entry_points.fused_linear_loss import fused_linear_pg_loss
from nemo_is_plugin.distributed.entry_points.logit_loss import LogitClippedPGLoss
from nemo_is_plugin.distributed.head.fused_linear import fused_linear_logprobs
from nemo_is_plugin.distributed.head.vocab_parallel import vocab_parallel_logprobs
from nemo_is_plugin.distributed.parallel.context_parallel import CPTokenLayout, cp_layout
from nemo_is_plugin.distributed.parallel.cp_sharding import (
    CP_ORDERS,
    local_cu_seqlens,
    local_tokens,
    num_chunks,
    shard_packed,
    shard_padded,
)
from nemo_is_plugin.distributed.parallel.data_parallel import all_reduce_metrics
from nemo_is_plugin.loss import ClippedPGLoss, LossInputs
from nemo_is_plugin.loss.layout import TokenLayout

from ._loss_cases import LOSS_CONFIGS, cu_seqlens, global_counts, make_batch, pack, padded_lengths

TESTS_DIR = str(Path(__file__).resolve().parents[1])


def _logit_call(config, logits, data, *, log_entropy=True, **call_kwargs):
    def run():
        x = logits.detach().clone().requires_grad_(True)
        fn = LogitClippedPGLoss(ClippedPGLoss(config), chunk_size=7, log_entropy=log_entropy)
        with count_host_syncs() as syncs:
            loss, metrics = fn(x, data, *global_counts(data), **call_kwargs)
        loss.backward()
        return (loss.detach(), metrics, x.grad), len(syncs)

    return run


# ---------------------------------------------------------------------------------------------------- LOGIT entry
@pytest.mark.parametrize("name", sorted(LOSS_CONFIGS))
def test_logit_loss_padded_is_device_clean(name):
    logits, data, _ = make_batch(11)
    (got, syncs), (want, _) = run_guarded_and_plain(_logit_call(LOSS_CONFIGS[name], logits, data))
    assert_identical(got, want)
    assert "entropy" in got[1]
    assert syncs == 1  # the metrics, entropy included


@pytest.mark.parametrize("as_list", [True, False], ids=["cu_list", "cu_tensor"])
@pytest.mark.parametrize("name", ["nemo_rl_default", "ctpo_cumulative_is", "gspo_nemo_rl", "seq_mis_veto"])
def test_logit_loss_packed_is_device_clean(name, as_list):
    logits, data, lengths = make_batch(12)
    lp = padded_lengths(lengths, 2)
    cu = cu_seqlens(lp)
    packed = pack(logits, lp).unsqueeze(0)
    call = _logit_call(LOSS_CONFIGS[name], packed, data, cu_seqlens_padded=cu.tolist() if as_list else cu)
    (got, syncs), (want, _) = run_guarded_and_plain(call)
    assert_identical(got, want)
    assert syncs == (1 if as_list else 2)  # + one read of cu_seqlens when it is a (device) tensor


# ---------------------------------------------------------------------------------------------------- layouts
def test_layout_constructors_read_nothing_back():
    with device_guard(), count_host_syncs() as syncs:
        dev = torch.device("cpu")
        TokenLayout.padded(3, 5, device=dev)
        TokenLayout.packed([0, 3, 7, 8], device=dev)
        for order in CP_ORDERS:
            cp_layout(None, order, num_seqs=2, seq_len=8, device=dev)
            cp_layout(None, order, cu_seqlens_padded=[0, 4, 12], device=dev)
            lt = local_tokens([4, 8], 0, 1, order, dev)
            CPTokenLayout(lt.seq, lt.position, lt.chunk, 2, num_chunks(1, order), None, in_order=True)
    assert len(syncs) == 0, str(syncs)
    with count_host_syncs() as syncs:
        TokenLayout.packed(torch.tensor([0, 3, 7, 8]))  # a device tensor is read once
        TokenLayout(torch.tensor([0, 0, 1]), torch.tensor([0, 1, 0]), 2)  # the order is checked once
    assert len(syncs) == 2, str(syncs)


@pytest.mark.parametrize("order", CP_ORDERS)
@pytest.mark.parametrize("cp_size", [1, 2, 3])
def test_constructors_token_order_claims_hold(cp_size, order):
    """The CP maps list each sequence's chunks in position order: the claim ``in_order=True`` the constructors make
    is what the checking path finds, on every rank."""
    mult = num_chunks(cp_size, order)
    lengths = [mult * k for k in (1, 3, 2)]
    for rank in range(cp_size):
        lt = local_tokens(lengths, rank, cp_size, order)
        assert TokenLayout(lt.seq, lt.position, len(lengths)).in_memory_order
        chunk_id = lt.seq * mult + lt.chunk
        assert TokenLayout(chunk_id, lt.position, len(lengths) * mult).in_memory_order


def test_out_of_order_layout_prefix_sums():
    """A layout out of memory order (shuffled tokens) sorts them without reading them back: same prefix sums."""
    seq = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2])
    pos = torch.tensor([0, 1, 2, 0, 1, 0, 1, 2, 3])
    x = torch.arange(1.0, 10.0, dtype=torch.float64)
    perm = torch.tensor([4, 0, 8, 2, 6, 1, 3, 7, 5])
    shuffled = TokenLayout(seq[perm], pos[perm], 3)
    assert not shuffled.in_memory_order
    want = TokenLayout(seq, pos, 3, in_order=True).prefix_sum(x)
    torch.testing.assert_close(shuffled.prefix_sum(x[perm]), want[perm], rtol=0, atol=0)
    torch.testing.assert_close(want, torch.tensor([1.0, 3, 6, 4, 9, 6, 13, 21, 30], dtype=torch.float64))


@pytest.mark.parametrize("order", CP_ORDERS)
@pytest.mark.parametrize(
    "name",
    [
        "nemo_rl_default",
        "ctpo_cumulative_is",
        "cumulative_mean_seq_is_icepop",
        "gspo_token_seqmean_is_tis",
        "seq_mask_tis",
    ],
)
def test_cp_layout_single_process_is_device_clean(name, order):
    """CPTokenLayout with no group (one rank holding every chunk) equals the packed layout, under the guard, with the
    one host sync of the metrics."""
    _, data, lengths = make_batch(13, dtype=torch.float64)
    lp = padded_lengths(lengths, num_chunks(1, order))
    cu = [0] + torch.tensor(lp).cumsum(0).tolist()
    n_seq, n_tok = global_counts(data)
    tokens = {
        k: pack(data[k][:, 1:].double(), lp)
        for k in ("token_mask", "advantages", "prev_logprobs", "generation_logprobs", "reference_policy_logprobs")
    }
    curr = (tokens["prev_logprobs"] + 0.05 * torch.sin(torch.arange(len(tokens["prev_logprobs"])))).clamp(max=0)
    loss_fn = build_loss_fn(LOSS_CONFIGS[name])

    def run(layout_of):
        def call():
            layout = layout_of()
            c = curr.clone().requires_grad_(True)
            inputs = LossInputs(
                curr_logprobs=c,
                prev_logprobs=tokens["prev_logprobs"],
                generation_logprobs=tokens["generation_logprobs"],
                reference_logprobs=tokens["reference_policy_logprobs"],
                advantages=tokens["advantages"],
                token_mask=tokens["token_mask"],
                sample_mask=data["sample_mask"].double(),
                global_valid_seqs=n_seq,
                global_valid_toks=n_tok,
                rewards=data["rewards"].double(),
            )
            with count_host_syncs() as syncs:
                loss, metrics = loss_fn.compute(inputs, layout)
            loss.backward()
            return (loss.detach(), metrics, c.grad), len(syncs)

        return call

    lengths_t = [b - a for a, b in zip(cu[:-1], cu[1:])]

    def cp():
        lt = local_tokens(lengths_t, 0, 1, order, torch.device("cpu"))
        return CPTokenLayout(lt.seq, lt.position, lt.chunk, len(lengths_t), num_chunks(1, order), None, in_order=True)

    (got, syncs), (want, _) = run_guarded_and_plain(run(cp))
    assert_identical(got, want)
    assert syncs == 1
    (packed, _) = run(lambda: TokenLayout.packed(cu, device=torch.device("cpu")))()
    torch.testing.assert_close(got[0], packed[0], rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(got[2], packed[2], rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("order", CP_ORDERS)
def test_cp_sharding_helpers_are_device_clean(order):
    """Sharding a batch for CP ranks needs no group: every rank's shard under the guard, without a host sync."""
    x = torch.arange(2 * 12 * 3, dtype=torch.float32).reshape(2, 12, 3)
    cu = [0, 4, 12, 24]
    flat, cu_t = x.reshape(24, 3), torch.tensor(cu)

    def run():
        with count_host_syncs() as syncs:
            out = [(shard_padded(x, r, 2, order), shard_packed(flat, cu, r, 2, order)) for r in range(2)]
            out.append(local_cu_seqlens(cu_t, 2))
        return out, len(syncs)

    (got, syncs), (want, _) = run_guarded_and_plain(run)
    assert_identical(got, want)
    assert syncs == 0
    if order == "contiguous":
        torch.testing.assert_close(got[0][0], x[:, :6])
        torch.testing.assert_close(got[1][1], torch.cat([flat[2:4], flat[8:12], flat[18:24]]))


# ---------------------------------------------------------------------------------------------------- log-prob kernels
def test_vocab_parallel_logprobs_is_device_clean():
    logits, data, _ = make_batch(14)
    x0 = logits.reshape(-1, logits.shape[-1])
    target = data["input_ids"].reshape(-1)

    def run():
        x = x0.clone().requires_grad_(True)
        lp, ent = vocab_parallel_logprobs(x, target, None, chunk_size=7, with_entropy=True)
        (lp.sum() + 0.5 * ent.sum()).backward()
        return lp.detach(), ent.detach(), x.grad

    got, want = run_guarded_and_plain(run)
    assert_identical(got, want)


def test_fused_linear_logprobs_torch_backend_is_device_clean():
    p = make_problem(3, 9, 16, 37, seed=0)

    def run():
        h, w = p.hidden.clone().requires_grad_(True), p.weight.clone().requires_grad_(True)
        lp, ent = fused_linear_logprobs(h, w, p.target, chunk_size=5, with_entropy=True)
        (lp.sum() + ent.sum()).backward()
        return lp.detach(), ent.detach(), h.grad, w.grad

    got, want = run_guarded_and_plain(run)
    assert_identical(got, want)


def check_triton_backend_under_guard() -> None:
    """Child-process entry (Triton reads TRITON_INTERPRET at import): the Triton backend under the guard."""
    from helpers.device_guard import assert_identical, run_guarded_and_plain

    g = torch.Generator().manual_seed(0)
    x0, w0 = torch.randn(24, 32, generator=g), torch.randn(48, 32, generator=g) * 0.5
    target = torch.randint(0, 48, (24,), generator=g)

    def run():
        x, w = x0.clone().requires_grad_(True), w0.clone().requires_grad_(True)
        lp, ent = fused_linear_logprobs(x, w, target, chunk_size=10, with_entropy=True, backend="triton")
        (lp.sum() + ent.sum()).backward()
        return lp.detach(), ent.detach(), x.grad, w.grad

    got, want = run_guarded_and_plain(run)
    assert_identical(got, want)


def test_fused_linear_logprobs_triton_backend_is_device_clean():
    pytest.importorskip("triton")
    code = (
        f"import sys; sys.path.insert(0, {TESTS_DIR!r}); "
        "from distributed.test_device_clean import check_triton_backend_under_guard as f; f()"
    )
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]


@pytest.mark.parametrize("single_pass", [None, False], ids=["auto", "two_pass"])
@pytest.mark.parametrize("name", sorted(LOSS_CONFIGS))
def test_fused_linear_pg_loss_is_device_clean(name, single_pass):
    p = make_problem(3, 9, 16, 37, seed=0)
    loss_fn = build_loss_fn(LOSS_CONFIGS[name])

    def run():
        h, w = p.hidden.clone().requires_grad_(True), p.weight.clone().requires_grad_(True)
        loss, metrics = fused_linear_pg_loss(
            loss_fn,
            h,
            w,
            p.target,
            p.data,
            p.global_valid_seqs,
            p.global_valid_toks,
            chunk_size=5,
            single_pass=single_pass,
        )
        loss.backward()
        return loss.detach(), metrics, h.grad, w.grad

    got, want = run_guarded_and_plain(run)
    assert_identical(got, want)


# ---------------------------------------------------------------------------------------------------- DP helpers
def test_dp_metric_reduction_uses_the_group_device(monkeypatch):
    """NCCL reduces CUDA tensors only: the host metrics go to the current CUDA device for an NCCL group."""
    import torch.distributed as dist

    seen = []
    monkeypatch.setattr(dist, "get_backend", lambda group: dist.Backend.NCCL)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch, "tensor", lambda data, **kw: seen.append(kw.get("device")) or torch.zeros(len(data)))
    monkeypatch.setattr(dist, "all_reduce", lambda t, op=None, group=None: None)
    all_reduce_metrics({"loss": 1.0, "x_min": 0.0, "x_max": 2.0}, dp_group=object())
    assert seen == [torch.device("cuda", 0)] * 3
    monkeypatch.setattr(dist, "get_backend", lambda group: dist.Backend.GLOO)
    seen.clear()
    all_reduce_metrics({"loss": 1.0}, dp_group=object())
    assert seen == [torch.device("cpu")]
