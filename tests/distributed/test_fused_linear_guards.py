"""The fused LM-head paths are sync-free inside their chunk loops and create every tensor on the inputs' device.

Host syncs (tests/helpers/device_guard.py counts every op that would stall the host on a GPU): none comes from the fused
path's own modules in the forward of any schedule, and the number of syncs of a whole call does not change with the
number of chunks (1 vs 24), so nothing anywhere runs per chunk. What remains per call comes from the loss's input
validation, its layout and its metrics dict (outside these modules). The single pass's backward may read the upstream
gradient when it lives on the CPU (a free check there: it skips a multiply when it is exactly 1); never on a GPU.

Device: under ``device_guard`` tensor factories without ``device=`` are rejected and the default device is ``meta``
(the inputs stay on the CPU: a tensor created without the inputs' device would land on ``meta`` and fail).
"""

from __future__ import annotations

import pytest
import torch
from helpers.device_guard import PACKAGE_DIR, DeviceLessTensorError, count_host_syncs, device_guard

from nemo_is_plugin import build_loss_fn
from nemo_is_plugin.apps.bench.problem import make_problem
from nemo_is_plugin.distributed.entry_points.fused_linear_loss import fused_linear_pg_loss
from nemo_is_plugin.distributed.head.fused_linear import fused_linear_logprobs
from nemo_is_plugin.distributed.head.vocab_parallel import vocab_parallel_logprobs

FUSED_FILES = (
    "fused_linear.py",
    "fused_linear_loss.py",
    "vocab_parallel.py",
    "chunk_math.py",
    "chunk_inplace.py",
    "gemm.py",
    "softmax_partials.py",
    "triton_logprob.py",
    "separable.py",
)
CONFIGS = {
    "token_tis_k3_nll": dict(
        ratio_level="token",
        use_importance_sampling_correction=True,
        truncated_importance_sampling_type="tis",
        truncated_importance_sampling_ratio=1.05,
        reference_policy_kl_penalty=0.1,
        positive_example_nll_weight=0.2,
    ),
    "cumulative_log_clip": dict(
        ratio_level="cumulative",
        log_ratio_clip_low=0.01,
        log_ratio_clip_high=0.015,
        clip_position_power=0.5,
        use_importance_sampling_correction=True,
        is_correction_level="cumulative",
    ),
    "sequence_two_pass": dict(
        ratio_level="sequence",
        loss_aggregation="seq-mean-token-mean",
        use_importance_sampling_correction=True,
        is_correction_level="sequence_mean",
    ),
}


def _problem():
    p = make_problem(3, 9, 16, 37, seed=0)
    p.data["rewards"] = torch.tensor([1.0, 0.0, 1.0])
    return p


def _pg_loss(p, name, chunk_size, **kwargs):
    h, w = p.hidden.clone().requires_grad_(True), p.weight.clone().requires_grad_(True)
    loss, metrics = fused_linear_pg_loss(
        build_loss_fn(CONFIGS[name]),
        h,
        w,
        p.target,
        p.data,
        p.global_valid_seqs,
        p.global_valid_toks,
        chunk_size=chunk_size,
        temperature=0.9,
        **kwargs,
    )
    return loss, metrics, h, w


# ---------------------------------------------------------------------------------------------------- host syncs
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_pg_loss_forward_is_sync_free_in_the_fused_modules_and_per_chunk(name):
    p = _problem()
    counts = {}
    for chunk_size in (1, 1000):  # 24 chunks vs one
        with count_host_syncs() as fwd:
            loss, _, h, w = _pg_loss(p, name, chunk_size)
        with count_host_syncs() as bwd:
            loss.backward()
        assert fwd.from_files(FUSED_FILES) == [], fwd.from_files(FUSED_FILES)
        assert len(bwd.from_files(FUSED_FILES)) <= 1 and {r.function for r in bwd.from_files(FUSED_FILES)} <= {
            "_is_one_on_cpu"
        }, str(bwd)
        counts[chunk_size] = (len(fwd), len(bwd))
    assert counts[1] == counts[1000], counts  # nothing runs per chunk, in any module
    assert counts[1][0] <= 8, str(fwd)  # validation, layout, metrics: a few per call


def test_logprob_entry_points_have_no_sync_at_all():
    p = _problem()
    coef = torch.randn(p.target.shape, generator=torch.Generator().manual_seed(1))
    with count_host_syncs() as rec:
        h, w = p.hidden.clone().requires_grad_(True), p.weight.clone().requires_grad_(True)
        lp, ent = fused_linear_logprobs(h, w, p.target, chunk_size=4, temperature=0.7, with_entropy=True)
        ((lp * coef).sum() + ent.sum()).backward()
        logits = (p.hidden @ p.weight.t()).requires_grad_(True)
        lp, ent = vocab_parallel_logprobs(logits, p.target, chunk_size=4, with_entropy=True)
        ((lp * coef).sum() + ent.sum()).backward()
    assert len(rec) == 0, str(rec)


def test_sync_counter_sees_the_syncing_ops():
    x = torch.arange(6.0)
    with count_host_syncs() as rec:
        x[x > 2].sum()
        torch.nonzero(x)
        bool(x[0] == 0)
        x.tolist()
        torch.where(x > 2, x, 0.0)  # not a sync
    assert [r.op for r in rec.records] == ["aten.index", "aten.nonzero", "aten._local_scalar_dense", "Tensor.tolist"]


# ---------------------------------------------------------------------------------------------------- devices
@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("weight_grad", ["autograd", "main_grad"])
def test_pg_loss_creates_no_tensor_without_a_device(name, weight_grad):
    p = _problem()
    h, w = p.hidden.clone().requires_grad_(True), p.weight.clone().requires_grad_(True)
    main_grad = torch.zeros(w.shape) if weight_grad == "main_grad" else None
    with device_guard():
        loss, _ = fused_linear_pg_loss(
            build_loss_fn(CONFIGS[name]),
            h,
            w,
            p.target,
            p.data,
            p.global_valid_seqs,
            p.global_valid_toks,
            chunk_size=5,
            grad_weight_out=main_grad,
        )
        loss.backward()
    assert h.grad is not None and (w.grad is None) == (main_grad is not None)


def test_logprob_entry_points_run_under_a_meta_default_device():
    """Inputs on the CPU, default device ``meta``: every tensor the entry points create must follow the inputs."""
    p = _problem()
    h, w = p.hidden.clone().requires_grad_(True), p.weight.clone().requires_grad_(True)
    logits = (p.hidden @ p.weight.t()).requires_grad_(True)
    with device_guard():  # and no device-less factory in any package file they reach
        lp, ent = fused_linear_logprobs(h, w, p.target, chunk_size=4, temperature=0.7, with_entropy=True)
        (lp.sum() + ent.sum()).backward()
        lp2, ent2 = vocab_parallel_logprobs(logits, p.target, chunk_size=4, with_entropy=True)
        (lp2.sum() + ent2.sum()).backward()
    for t in (lp, ent, h.grad, w.grad, lp2, logits.grad):
        assert t.device.type == "cpu" and torch.isfinite(t).all()


def test_device_guard_rejects_a_device_less_factory_in_a_package_frame():
    code = compile("torch.zeros(3)", str(PACKAGE_DIR / "distributed" / "fused_linear.py"), "exec")
    with device_guard(), pytest.raises(DeviceLessTensorError, match="zeros called without device"):
        exec(code, {"torch": torch})
    with device_guard():
        exec(
            compile("torch.zeros(3, device='cpu')", str(PACKAGE_DIR / "distributed" / "fused_linear.py"), "exec"),
            {"torch": torch},
        )
