"""The compiled epilogue (loss/compiled.py) against the eager loss: same loss, gradient and every metric (float32 and
float64), one compile per configuration whatever the batch and sequence lengths, one host read per call, and at most
40 kernel-launching operations per call as tools/launch_count.py counts them on a CPU.

Cost: each case compiles once per test session (inductor, forward + backward). Measured on 2 CPU cores shared with
other jobs: the 13 tests took 3.6 min with inductor's FX graph cache warm (~/.cache or /tmp/torchinductor_*), 13-18 min
cold (30-240 s per case). The sweep over every objective (``slow``, 13 tests, 3.3 min) traces each config with dynamo
alone (``backend="eager"``: no code generation)."""

from __future__ import annotations

import functools
import math
from typing import Any

import pytest
import torch
from helpers.device_guard import count_host_syncs
from torch._dynamo.utils import counters
from torch._inductor.utils import run_and_get_code

from nemo_is_plugin import build_loss_fn
from nemo_is_plugin.apps.bench.jobs import BENCH_LOSS_CONFIG
from nemo_is_plugin.apps.bench.problem import make_problem
from nemo_is_plugin.loss.compiled import CompiledLoss
from nemo_is_plugin.loss.objectives import OBJECTIVES
from tools.launch_count import LaunchCounter, count_with_graphs, kernel_calls

_IS = dict(use_importance_sampling_correction=True)
# A sample across objectives, IS levels, truncations, rejections, KL, aggregations and the NLL term: each case is a
# minutes-long compile on this machine, so four cases combine several factors each.
CASES: dict[str, tuple[dict[str, Any], torch.dtype]] = {
    "bench_f32": (BENCH_LOSS_CONFIG, torch.float32),  # ppo_clip, token TIS, k3 KL: the head benchmark's loss
    "cppo_seq_mask_f64": (
        dict(
            policy_objective="cppo",
            **_IS,
            is_correction_level="token",
            truncated_importance_sampling_type="seq-mask-tis",
            truncated_importance_sampling_ratio=1.25,
            truncated_importance_sampling_ratio_min=0.8,
            loss_aggregation="seq-mean-token-mean",
        ),
        torch.float64,
    ),
    "gmpo_icepop_seq_rule_veto_f32": (
        dict(
            policy_objective="gmpo",
            gmpo_clip_low=0.4,
            gmpo_clip_high=0.4,
            loss_aggregation="seq-mean-token-mean",
            **_IS,
            is_correction_level="sequence_mean",
            truncated_importance_sampling_type="icepop",
            truncated_importance_sampling_ratio=5.0,
            truncated_importance_sampling_ratio_min=0.5,
            importance_sampling_rejection_rules=[{"option": "seq_max_k2", "threshold": 2.0}],
            importance_sampling_veto_threshold=1e-4,
            reference_policy_kl_penalty=0.05,
            reference_policy_kl_type="k1",
        ),
        torch.float32,
    ),
    "dppo_cumulative_band_nll_f64": (
        dict(
            policy_objective="dppo_tv",
            dppo_delta_low=0.2,
            dppo_delta_high=0.28,
            **_IS,
            is_correction_level="cumulative",
            truncated_importance_sampling_type="tis",
            truncated_importance_sampling_ratio=2.0,
            truncated_importance_sampling_ratio_min=0.5,
            importance_sampling_rejection="geo-rs",
            importance_sampling_rejection_min=0.8,
            importance_sampling_rejection_max=1.25,
            positive_example_nll_weight=0.1,
            loss_aggregation="token-sum",
        ),
        torch.float64,
    ),
}
TOLERANCE = {torch.float32: 2e-6, torch.float64: 1e-12}  # relative, as the golden suites state them per dtype


def call_args(batch: int, seq_len: int, dtype: torch.dtype, seed: int = 0) -> dict[str, Any]:
    p = make_problem(batch, seq_len, 32, 256, seed=seed, base_logprobs="model")
    data = {k: v.to(dtype) if v.is_floating_point() else v for k, v in p.data.items()}
    g = torch.Generator().manual_seed(seed + 1)
    x = data["prev_logprobs"][:, 1:] + 0.05 * torch.randn(data["prev_logprobs"][:, 1:].shape, generator=g).to(dtype)
    x = torch.minimum(x, torch.zeros_like(x))
    return dict(
        next_token_logprobs=x, data=data, global_valid_seqs=p.global_valid_seqs, global_valid_toks=p.global_valid_toks
    )


def run(loss_fn: Any, args: dict[str, Any]) -> tuple[torch.Tensor, dict[str, float], torch.Tensor]:
    x = args["next_token_logprobs"].clone().requires_grad_(True)
    loss, metrics = loss_fn(**{**args, "next_token_logprobs": x})
    loss.backward()
    assert x.grad is not None
    return loss.detach(), metrics, x.grad


@functools.cache
def compiled_case(name: str) -> tuple[CompiledLoss, list[int], tuple, list[tuple]]:
    """The case's compiled loss, compiled once per session by its first call (forward + backward), with the kernel
    calls of its generated graphs, that first call's result, and, right after it, the compiled and eager results at
    two other batch and sequence lengths with the number of graphs dynamo compiled for them (expected 0)."""
    config, dtype = CASES[name]
    loss = CompiledLoss(build_loss_fn(config))
    result, sources = run_and_get_code(run, loss, call_args(4, 65, dtype))
    assert loss.compiled.compiled is not None  # compiled: not fallen back to the eager loss
    graphs = counters["stats"]["unique_graphs"]
    reshaped = []
    for batch, seq_len, seed in ((3, 41, 1), (7, 130, 2)):
        args = call_args(batch, seq_len, dtype, seed)
        reshaped.append((run(build_loss_fn(config), args), run(loss, args)))
    recompiles = counters["stats"]["unique_graphs"] - graphs
    return loss, [kernel_calls(src) for src in sources], result, [*reshaped, recompiles]


def assert_same(eager: tuple, compiled: tuple, dtype: torch.dtype) -> None:
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(compiled[0], eager[0], rtol=tol, atol=tol)
    torch.testing.assert_close(compiled[2], eager[2], rtol=tol, atol=tol * eager[2].abs().max().item())
    assert list(compiled[1]) == list(eager[1])  # the same metrics in the same order
    assert compiled[1].denominators == eager[1].denominators
    for name, want in eager[1].items():
        got = compiled[1][name]
        same = got == want or (math.isnan(got) and math.isnan(want))
        assert same or abs(got - want) <= tol * max(1.0, abs(want)), (name, got, want)


@pytest.mark.parametrize("name", list(CASES))
def test_compiled_equals_eager(name):
    _, dtype = CASES[name]
    _, _, first, _ = compiled_case(name)
    assert_same(run(build_loss_fn(CASES[name][0]), call_args(4, 65, dtype)), first, dtype)


@pytest.mark.parametrize("name", list(CASES))
def test_no_recompile_as_batch_and_sequence_lengths_change(name):
    *reshaped, recompiles = compiled_case(name)[3]
    assert recompiles == 0
    for eager, compiled in reshaped:
        assert_same(eager, compiled, CASES[name][1])


@pytest.mark.parametrize("name", list(CASES))
def test_one_host_read_and_at_most_40_ops_per_call(name):
    config, dtype = CASES[name]
    loss, graph_kernels, _, _ = compiled_case(name)
    assert len(graph_kernels) == 2  # one forward and one backward graph: no graph break
    args = call_args(4, 65, dtype)
    total, syncs, kernels = count_with_graphs(lambda: run(loss, args))
    assert syncs == 1  # the metrics and the inputs' checks, read together
    assert kernels == sum(graph_kernels) and 0 < total <= 40
    with count_host_syncs() as eager_syncs, LaunchCounter() as eager_ops:
        run(build_loss_fn(config), args)
    assert len(eager_syncs) == 2 and eager_ops.count > 10 * total


def test_bad_inputs_raise_as_in_eager():
    loss = compiled_case("bench_f32")[0]
    args = call_args(4, 65, torch.float32)
    args["data"] = {**args["data"], "prev_logprobs": args["data"]["prev_logprobs"].clone()}
    args["data"]["prev_logprobs"][1, 5] = math.nan
    with pytest.raises(ValueError) as eager_error:
        run(build_loss_fn(BENCH_LOSS_CONFIG), args)
    with pytest.raises(ValueError) as compiled_error:
        run(loss, args)
    assert str(compiled_error.value) == str(eager_error.value)
    assert "prev_logprobs" in str(eager_error.value)


_OBJECTIVE_KEYS: dict[str, dict[str, Any]] = {
    "dppo_tv": dict(dppo_delta_low=0.2, dppo_delta_high=0.28),
    "dppo_kl": dict(dppo_delta_low=0.2, dppo_delta_high=0.28),
    "dro": dict(dro_beta=0.1),
    "gmpo": dict(
        gmpo_clip_low=0.4,
        gmpo_clip_high=0.4,
        loss_aggregation="seq-mean-token-mean",
        is_correction_level="sequence_mean",
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("objective", sorted(OBJECTIVES))
def test_every_objective_is_one_graph(objective):
    """Every objective, with TIS on (token level; GMPO: sequence_mean, which it requires): the epilogue traces as one
    graph (``fullgraph``: a break raises) and, run by dynamo's eager backend, equals the eager loss in float64."""
    config = dict(policy_objective=objective, **_OBJECTIVE_KEYS.get(objective, {}), **_IS)
    config.update(truncated_importance_sampling_type="tis", truncated_importance_sampling_ratio=2.0)
    loss = CompiledLoss(build_loss_fn(config), backend="eager")
    args = call_args(4, 65, torch.float64)
    assert_same(run(build_loss_fn(config), args), run(loss, args), torch.float64)
    assert loss.compiled.compiled is not None  # compiled, not fallen back to eager
