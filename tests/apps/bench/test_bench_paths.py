"""The benchmark's path table: availability per device, the keyword-argument checks of the fused variants, and a
failing measurement recorded as a failed row with its error (not crashed on, not an empty cell)."""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import os

import pytest
import torch

from nemo_is_plugin.apps.bench import runner
from nemo_is_plugin.apps.bench.catalog import bench_paths
from nemo_is_plugin.apps.bench.jobs import bench_loss_fn, fwd_bwd_job
from nemo_is_plugin.apps.bench.paths import FusedVariant, fused_path, logprob_paths
from nemo_is_plugin.apps.bench.problem import make_problem
from nemo_is_plugin.apps.bench.shapes import PATHS, QUICK_SHAPES, BenchConfig
from nemo_is_plugin.distributed.entry_points.fused_linear_loss import fused_linear_pg_loss


def test_every_path_is_in_the_table_and_the_plugin_subset_is_unchanged():
    assert [p.name for p in bench_paths()] == list(PATHS)
    assert [p.name for p in logprob_paths()] == ["naive", "from_logits", "fused_linear", "fused_2pass"]


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="the interpreter makes Triton usable on CPU")
def test_on_cpu_the_gpu_only_rows_say_why():
    paths = {p.name: p for p in bench_paths(device=torch.device("cpu"))}
    for name in ("fused_triton", "fused_2pass_triton"):
        assert "CUDA" in paths[name].unavailable
    assert "CUDA" in paths["cce"].unavailable or "not installed" in paths["cce"].unavailable
    if importlib.util.find_spec("liger_kernel") is None:
        assert paths["liger"].unavailable.startswith("not installed")
    for name in ("naive", "from_logits", "fused_linear", "fused_2pass"):
        assert paths[name].unavailable is None and paths[name].fwdbwd_unavailable is None


def test_a_keyword_the_entry_points_lack_is_reported_not_passed():
    single = fused_path(FusedVariant("x", None, "d", {"no_such_option": 1}), chunk_size=4)
    assert "`no_such_option` argument" in single.unavailable
    if "backend" not in inspect.signature(fused_linear_pg_loss).parameters:
        triton = next(p for p in bench_paths() if p.name == "fused_triton")
        assert "fused_linear_pg_loss takes no `backend` argument" in triton.fwdbwd_unavailable


def test_a_two_pass_variant_falls_back_to_log_probs_then_loss():
    """A keyword only ``fused_linear_logprobs`` takes: the two-pass schedule is spelled out, and its loss and
    gradients equal the naive path's."""
    path = fused_path(FusedVariant("y", False, "d", {"temperature": 1.0}), chunk_size=5)
    assert path.unavailable is None and path.fwdbwd_unavailable is None and not path.times_forward
    p, loss_fn = make_problem(3, 9, 16, 40, seed=0, base_logprobs="model"), bench_loss_fn()
    got, want = fwd_bwd_job(path, p, loss_fn)(), fwd_bwd_job(logprob_paths()[0], p, loss_fn)()
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_a_failing_measurement_is_a_failed_row_with_its_error_and_the_run_goes_on(monkeypatch, tmp_path):
    """fused_2pass's forward+backward raises, and so does every path's float64 reference check: each is recorded in
    its row's ``failed`` with the error, its cells read "failed" (never empty), the CLI report lists the errors, and
    every row says which chunk-math backend it ran on."""
    from rich.console import Console

    from nemo_is_plugin.apps.bench.failures import failure_lines
    from nemo_is_plugin.apps.bench.report import table_cells
    from nemo_is_plugin.apps.cli.bench import _report
    from tools.bench_docs.performance_page import render_markdown

    def broken(*_args, **_kw):
        raise RuntimeError("CUDA out of memory. Tried to allocate 9 GiB\nsecond line")

    def paths_with_a_broken_one(chunk_size=None, device=None):
        paths = bench_paths(chunk_size, device)
        return [dataclasses.replace(p, loss=broken) if p.name == "fused_2pass" else p for p in paths]

    def no_reference(*_args, **_kw):
        raise ValueError("takes bf16 only")

    monkeypatch.setattr(runner, "bench_paths", paths_with_a_broken_one)
    monkeypatch.setattr(runner, "path_errors", no_reference)
    cfg = BenchConfig.quick(
        shapes=QUICK_SHAPES[:1], paths=("naive", "fused_linear", "fused_2pass"), memory_tokens=(), repeats=1
    )
    results = runner.run_benchmark(cfg)
    rows = {r["path"]: r for r in results["rows"]}
    assert list(rows) == ["matmul", "naive", "fused_linear", "fused_2pass", "loss"] and results["skipped"] == {}
    oom = "failed on tiny-a (cpu): RuntimeError: CUDA out of memory. Tried to allocate 9 GiB"
    reference = "failed on tiny-a float64 reference errors: ValueError: takes bf16 only"
    assert rows["fused_2pass"]["failed"] == {"fwdbwd": oom, "reference": reference}
    assert rows["fused_2pass"]["fwdbwd_s"] is None and rows["fused_2pass"]["loss_grad_err"] is None
    for name in ("naive", "fused_linear"):
        assert rows[name]["failed"] == {"reference": reference}
        assert rows[name]["fwdbwd_s"] > 0 and rows[name]["dx_err"] < 1e-5 and rows[name]["loss_err"] < 1e-5
        assert 0 <= rows[name]["loss_grad_err"] < 1e-5
    assert rows["matmul"]["failed"] == {} and rows["matmul"]["lp_err"] is not None  # no path function involved
    # the backend that ran: the fused path's chunk math on torch (CPU), none for the rest
    assert rows["fused_linear"]["backend"] == "torch" and results["triton_fallback"] is None
    assert [rows[n]["backend"] for n in ("matmul", "naive", "fused_2pass", "loss")] == [None] * 4
    headers, cells = table_cells(results)
    table = {row[headers.index("path")]: dict(zip(headers, row)) for row in cells}
    assert table["fused_2pass"]["f+b / mm"] == "failed" and table["fused_2pass"]["dX err"] == "failed"
    assert table["fused_2pass"]["fwd / mm"] == "-"  # a two-pass forward is fused_linear's: not measured, not failed
    assert table["fused_linear"]["max dlogp err"] == "failed" and table["fused_linear"]["backend"] == "torch"
    assert table["naive"]["backend"] == "-" and table["naive"]["f+b / mm"].endswith("x")
    assert f"tiny-a fused_2pass forward+backward: {oom}" in failure_lines(results)
    assert f"- tiny-a fused_2pass forward+backward: {oom}" in render_markdown(results)
    console = Console(record=True, width=300)
    _report(results, console, tmp_path)
    assert f"failed: tiny-a fused_2pass forward+backward: {oom}" in console.export_text()
    assert results["config"]["quick"] is True


def test_a_path_without_an_fp32_backward_skips_the_algorithm_check_with_its_reason(monkeypatch):
    """CCE's backward takes bf16 / fp16 only (seen on an H100): its fp32 check against float64 is skipped with the
    reason instead of failing, its timings and bf16 errors still reported; the other paths are checked as before."""

    def paths_with_a_bf16_only_one(chunk_size=None, device=None):
        paths = bench_paths(chunk_size, device)
        why = "its backward takes bf16 / fp16 embeddings only"
        return [dataclasses.replace(p, fp32_check_unavailable=why) if p.name == "fused_2pass" else p for p in paths]

    monkeypatch.setattr(runner, "bench_paths", paths_with_a_bf16_only_one)
    cfg = BenchConfig.quick(shapes=QUICK_SHAPES[:1], paths=("naive", "fused_2pass"), memory_tokens=(), repeats=1)
    results = runner.run_benchmark(cfg)
    rows = {r["path"]: r for r in results["rows"]}
    assert results["skipped"] == {
        "fused_2pass loss gradient vs float64 (tiny-a)": "its backward takes bf16 / fp16 embeddings only"
    }
    assert rows["fused_2pass"]["failed"] == {} and rows["fused_2pass"]["loss_grad_err"] is None
    assert rows["fused_2pass"]["fwdbwd_s"] > 0 and rows["fused_2pass"]["dx_err"] < 1e-5
    assert 0 <= rows["naive"]["loss_grad_err"] < 1e-5


def test_a_cpu_run_records_its_setting_and_says_it_is_not_comparable_to_the_gpu_targets():
    from nemo_is_plugin.apps.bench.report import comparability_note, run_targets

    cfg = BenchConfig(
        shapes=QUICK_SHAPES[:1], tokens=16, paths=("naive", "fused_linear"), memory_tokens=(), repeats=1, ref_tokens=8
    )
    results = runner.run_benchmark(cfg)
    assert results["config"]["quick"] is False and results["config"]["device"] == "cpu"
    assert results["config"]["dtype"] == "float32" and results["config"]["statistic"] == "best"
    assert comparability_note(results).startswith("CPU run: not comparable to the GPU targets")
    assert any("fused forward <=" in t["target"] for t in run_targets(results))  # the CPU targets apply
