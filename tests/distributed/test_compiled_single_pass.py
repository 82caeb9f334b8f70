"""The fused LM-head single pass with a compiled loss (``fused_linear_pg_loss(CompiledLoss(...))``): the batch
constants, each chunk's [n] step (log-probs from the merged partials and dL/dc, ``chunk_step``) and the loss with its
metrics are compiled graphs (loss/compiled.py). Against the eager single pass: the same loss, hidden-state and weight
gradients and every metric (float32 and float64), no recompilation as the batch and sequence lengths change, one
host read per call, and far fewer kernel-launching operations (tools/launch_count.py's CPU count).

Cost: three configs, each compiled once per session (about 20-60 s each on 2 CPU cores with inductor's cache cold)."""

from __future__ import annotations

import functools
import math
from typing import Any

import pytest
import torch
from torch._dynamo.utils import counters

from nemo_is_plugin import build_loss_fn
from nemo_is_plugin.apps.bench.jobs import BENCH_LOSS_CONFIG
from nemo_is_plugin.apps.bench.loss_gradient_timing import CONFIGS as TIMED_CONFIGS
from nemo_is_plugin.apps.bench.problem import HeadProblem, make_problem
from nemo_is_plugin.distributed.entry_points.fused_linear_loss import fused_linear_pg_loss
from nemo_is_plugin.loss.compiled import CompiledLoss
from tools.launch_count import CHUNKS, LaunchCounter, count_with_graphs

K = 3  # score centering's head size
CASES: dict[str, tuple[dict[str, Any], torch.dtype]] = {
    "bench_f32": (BENCH_LOSS_CONFIG, torch.float32),  # ppo_clip, token TIS, k3 KL
    # the causal ratio: the prefix carry crosses the chunks inside the compiled steps
    "ctpo_cumulative_f64": (TIMED_CONFIGS["cumulative_ctpo_clip"], torch.float64),
    "score_centering_tis_f64": (  # the head's log-probs and gradient from the same chunk
        dict(
            reference_policy_kl_penalty=0.0,
            score_centering=True,
            score_centering_top_k=K,
            use_importance_sampling_correction=True,
            truncated_importance_sampling_type="tis",
            truncated_importance_sampling_ratio=1.5,
        ),
        torch.float64,
    ),
}
TOLERANCE = {torch.float32: 2e-5, torch.float64: 1e-11}


def problem(name: str, batch: int, seq_len: int, seed: int = 0) -> HeadProblem:
    config, dtype = CASES[name]
    p = make_problem(batch, seq_len, 16, 64, seed=seed, dtype=dtype, base_logprobs="model")
    if config.get("score_centering"):  # the sampler's top-K head of a perturbed distribution, [B, S, K]
        g = torch.Generator().manual_seed(seed + 100)
        sampler = torch.log_softmax(torch.randn(batch, seq_len, 64, generator=g, dtype=torch.float64), -1)
        top = sampler.topk(K, -1)
        p.data = {**p.data, "rollout_topk_ids": top.indices, "rollout_topk_logprobs": top.values}
    return p


def run(
    loss_fn: Any, p: HeadProblem, ragged: bool = True
) -> tuple[torch.Tensor, dict[str, float], torch.Tensor, torch.Tensor]:
    h, w = p.hidden.clone().requires_grad_(True), p.weight.clone().requires_grad_(True)
    chunk = p.target.numel() // CHUNKS + int(ragged)  # ragged: a shorter last chunk
    loss, metrics = fused_linear_pg_loss(
        loss_fn, h, w, p.target, p.data, p.global_valid_seqs, p.global_valid_toks, chunk_size=chunk, single_pass=True
    )
    loss.backward()
    assert h.grad is not None and w.grad is not None
    return loss.detach(), metrics, h.grad, w.grad


@functools.cache
def compiled_case(name: str) -> tuple[CompiledLoss, tuple, list]:
    """The case's compiled loss after its first (compiling) call, that call's result, and the eager and compiled
    results at two other batch and sequence lengths with the number of graphs dynamo compiled for them. The first call
    has equal chunks, the later ones a shorter last chunk."""
    loss = CompiledLoss(build_loss_fn(CASES[name][0]))
    first = run(loss, problem(name, 4, 33), ragged=False)
    graphs = counters["stats"]["unique_graphs"]
    reshaped = []
    for batch, seq_len, seed in ((3, 21, 1), (6, 50, 2)):
        p = problem(name, batch, seq_len, seed)
        reshaped.append((run(build_loss_fn(CASES[name][0]), p), run(loss, p)))
    return loss, first, [*reshaped, counters["stats"]["unique_graphs"] - graphs]


def assert_same(eager: tuple, compiled: tuple, dtype: torch.dtype) -> None:
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(compiled[0], eager[0], rtol=tol, atol=tol)
    for got, want in zip(compiled[2:], eager[2:]):  # dL/dhidden, dL/dweight
        torch.testing.assert_close(got, want, rtol=tol, atol=tol * want.abs().max().item())
    assert list(compiled[1]) == list(eager[1])
    for key, want in eager[1].items():
        got = compiled[1][key]
        assert got == want or (math.isnan(got) and math.isnan(want)) or abs(got - want) <= tol * max(1, abs(want)), (
            key,
            got,
            want,
        )


@pytest.mark.parametrize("name", list(CASES))
def test_compiled_single_pass_equals_the_eager_one(name):
    loss, first, _ = compiled_case(name)
    assert loss.compiled.compiled is not None and all(f.compiled is not None for f in loss._functions.values())
    # beside the epilogue: the batch constants, the chunk step, the torch backend's two passes (CPU), the head's
    names = {fn.__name__ for fn in loss._functions}
    passes = {"chunk_partials_", "grad_from_exp_", "head_logits", "add_head_columns_"}
    assert names == {"batch_constants", "chunk_step", "localize_target", "owned_column"} | passes | (
        {"localize_head"} if CASES[name][0].get("score_centering") else set()
    )
    assert_same(run(build_loss_fn(CASES[name][0]), problem(name, 4, 33), ragged=False), first, CASES[name][1])


@pytest.mark.parametrize("name", list(CASES))
def test_no_recompile_as_batch_and_sequence_lengths_change(name):
    *reshaped, recompiles = compiled_case(name)[2]
    assert recompiles == 0
    for eager, compiled in reshaped:
        assert_same(eager, compiled, CASES[name][1])


@pytest.mark.parametrize("name", list(CASES))
def test_one_host_read_and_a_fraction_of_the_eager_operations(name):
    loss = compiled_case(name)[0]
    p = problem(name, 4, 33)
    count_with_graphs(lambda: run(loss, p))  # dynamo guards on the torch-function mode stack: the counters' compiles
    total, syncs, kernels = count_with_graphs(lambda: run(loss, p))
    assert all(f.compiled is not None for f in loss._functions.values())  # none fell back to eager
    with LaunchCounter() as eager_ops:
        run(build_loss_fn(CASES[name][0]), p)
    assert syncs == 1  # the metrics and the inputs' checks, read together at the end of the forward
    # issue 46's bound: 8 x (the chunk's 3 GEMMs + 8) + 40, the compiled graphs' kernel calls included (the
    # constants, per chunk its step and the torch backend's two passes, the epilogue)
    assert 3 * CHUNKS + 2 <= kernels and total <= CHUNKS * (3 + 8) + 40
    assert total * 10 < eager_ops.count


def test_a_bad_input_raises_as_in_eager_after_the_pass():
    name = "bench_f32"
    loss = compiled_case(name)[0]
    p = problem(name, 4, 33)
    p.data = {**p.data, "prev_logprobs": p.data["prev_logprobs"].clone()}
    p.data["prev_logprobs"][2, 7] = math.inf
    with pytest.raises(ValueError) as eager_error:
        run(build_loss_fn(CASES[name][0]), p)
    with pytest.raises(ValueError) as compiled_error:
        run(loss, p)
    assert str(compiled_error.value) == str(eager_error.value) and "prev_logprobs" in str(eager_error.value)
