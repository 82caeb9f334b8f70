"""Compiled losses of several configurations in one process (loss/compiled.py): each compiles once, whatever the
order of the calls and the batch and sequence lengths, and none recompiles or falls back to the eager loss.

dynamo keeps its compiled graphs per code object, at most ``recompile_limit`` (8) of them; each CompiledLoss traces a
code object of its own (``compiled.epilogue``), so configs do not share, and overflow, one cache. Checked with the
limit lowered to 1 and ``fail_on_recompile_limit_hit``: any recompilation, or two configs sharing a code object,
raises. The graphs are traced by dynamo alone (``backend="eager"``, seconds per config): the check is dynamo's
caching, not code generation (inductor's graphs of the same configs: tests/loss/test_compiled.py)."""

from __future__ import annotations

import pytest
import torch
from helpers.compiled_golden import graphs_of
from torch._dynamo.utils import counters

from loss.test_compiled import CASES, assert_same, call_args, run
from nemo_is_plugin import build_loss_fn
from nemo_is_plugin.common import once
from nemo_is_plugin.loss.compiled import CompiledLoss

SHAPES = ((4, 65), (3, 41), (7, 130), (5, 9))  # (batch, sequence length) of the calls, in this order


def test_configs_in_one_process_compile_once_each():
    losses = {name: CompiledLoss(build_loss_fn(config), backend="eager") for name, (config, _) in CASES.items()}
    graphs = counters["stats"]["unique_graphs"]
    with torch._dynamo.config.patch(recompile_limit=1, fail_on_recompile_limit_hit=True):
        for seed, (batch, seq_len) in enumerate(SHAPES):
            for name, loss in losses.items():  # the configs' calls interleaved
                config, dtype = CASES[name]
                args = call_args(batch, seq_len, dtype, seed)
                assert_same(run(build_loss_fn(config), args), run(loss, args), dtype)
    assert {name: graphs_of(loss) for name, loss in losses.items()} == dict.fromkeys(losses, 1)
    assert counters["stats"]["unique_graphs"] - graphs == len(losses)
    assert all(loss.compiled.compiled is not None for loss in losses.values())  # none fell back to the eager loss


def test_a_recompile_would_be_caught():
    """The check above can fail: a config whose input structure changes (a float64 call after float32 ones) needs a
    second graph, which the lowered limit refuses."""
    config, _ = CASES["bench_f32"]
    loss = CompiledLoss(build_loss_fn(config), backend="eager")
    with torch._dynamo.config.patch(recompile_limit=1, fail_on_recompile_limit_hit=True):
        run(loss, call_args(4, 65, torch.float32))
        with pytest.raises(Exception, match="recompile_limit"):
            run(loss, call_args(4, 65, torch.float64))


def test_compute_with_caller_terms_runs_the_eager_loss_and_says_so(monkeypatch):
    """``compute`` with a caller's ``extra_metric_sums`` (not a graph input) is the eager loss's, with a warning."""
    monkeypatch.setattr(once, "_WARNED", set())  # the warning is once per process: this test sees it
    config, dtype = CASES["bench_f32"]
    eager = build_loss_fn(config)
    loss = CompiledLoss(eager, backend="eager")
    args = call_args(4, 65, dtype)
    inputs, layout = eager.prepare(args["next_token_logprobs"], args["data"], 1.0, 1.0)
    extra = {"caller_sum": torch.tensor(2.5)}
    with pytest.warns(UserWarning, match="extra_metric_sums is not compiled"):
        got, metrics = loss.compute(inputs, layout, extra_metric_sums=extra)
    want, want_metrics = eager.compute(inputs, layout, extra_metric_sums=extra)
    assert torch.equal(got, want) and dict(metrics) == dict(want_metrics) and metrics["caller_sum"] == 2.5
    assert graphs_of(loss) == 0  # nothing was compiled
