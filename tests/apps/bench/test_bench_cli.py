"""``nemo-is bench`` end to end on tiny shapes: table printed, JSON + PNG written, docs regenerated."""

from __future__ import annotations

import json

import typer
from typer.testing import CliRunner

from nemo_is_plugin.apps.bench.runner import count_steps, run_benchmark
from nemo_is_plugin.apps.bench.shapes import QUICK_SHAPES, BenchConfig
from nemo_is_plugin.apps.cli.bench import register
from tools.bench_docs.__main__ import main as bench_docs_main


def _app() -> typer.Typer:
    app = typer.Typer()

    @app.callback()
    def _root() -> None:  # keep "bench" a subcommand
        pass

    register(app)
    return app


def test_quick_bench_writes_results_plots_and_docs(tmp_path):
    out, docs = tmp_path / "out", tmp_path / "docs"
    args = [
        "bench",
        "--quick",
        "--model",
        "tiny-a",
        "--path",
        "naive",
        "--path",
        "fused_linear",
        "--path",
        "fused_2pass",
        "--memory-tokens",
        "32",
        "--memory-tokens",
        "64",
        "--out",
        str(out),
    ]
    result = CliRunner().invoke(_app(), args)
    assert result.exit_code == 0, result.output
    assert bench_docs_main(["cpu", str(out / "results.json"), "--docs-dir", str(docs)]) == 0
    assert "fused_linear" in result.output and "f+b / mm" in result.output and "tiny-b" not in result.output
    # quick numbers are not meaningful: said once, instead of a verdict per performance target
    assert "performance targets are not evaluated" in " ".join(result.output.split())
    assert not any(line.startswith(("ok  ", "no  ")) for line in result.output.splitlines())

    results = json.loads((out / "results.json").read_text())
    rows = {(r["model"], r["path"]): r for r in results["rows"]}
    assert {p for _, p in rows} == {"matmul", "naive", "fused_linear", "fused_2pass", "loss"}
    for model in ("tiny-a",):
        fused, two_pass = rows[(model, "fused_linear")], rows[(model, "fused_2pass")]
        assert fused["lp_err"] < 1e-5 and fused["grad_err"] < 1e-5
        assert fused["fwd_s"] > 0 and fused["fwdbwd_s"] > fused["fwd_s"]
        # one 16-token chunk of fp32 logits vs the naive path's [64, V] logits + log-softmax
        assert fused["fwd_peak"] < rows[(model, "naive")]["fwd_peak"] / 3
        # the two-pass row shares fused_linear's forward: only its forward+backward is timed
        assert two_pass["fwd_s"] is None and two_pass["fwdbwd_s"] > 0
        # the loss gradients of every path against the naive path in float64
        for name in ("naive", "fused_linear", "fused_2pass"):
            assert 0 <= rows[(model, name)]["loss_grad_err"] < 1e-5
        assert rows[(model, "matmul")]["loss_grad_err"] is None
    assert {p["tokens"] for p in results["memory_sweep"]} == {32, 64}
    # measured (not extrapolated) at the target token count, for naive and fused_linear only
    direct = {p["path"]: p for p in results["memory_direct"]}
    assert set(direct) == {"naive", "fused_linear"} and {p["tokens"] for p in direct.values()} == {1024}
    assert direct["naive"]["peak_bytes"] > 5 * direct["fused_linear"]["peak_bytes"]
    for name in ("perf_ratios.png", "perf_memory.png"):
        assert (out / name).stat().st_size > 1000 and (docs / "img" / name).stat().st_size > 1000
    page = (docs / "performance.md").read_text()
    assert "## Targets" in page and "| tiny-a | 64 | fused_linear |" in page

    # re-rendering a saved run measures nothing and reproduces the page
    (docs / "performance.md").unlink()
    again = CliRunner().invoke(
        _app(), ["bench", "--from-json", str(out / "results.json"), "--out", str(tmp_path / "out2")]
    )
    assert again.exit_code == 0, again.output
    assert bench_docs_main(["cpu", str(tmp_path / "out2" / "results.json"), "--docs-dir", str(docs)]) == 0
    assert (docs / "performance.md").read_text() == page


def test_unknown_path_or_model_is_a_usage_error():
    result = CliRunner().invoke(_app(), ["bench", "--quick", "--path", "bogus"])
    assert result.exit_code == 2 and "unknown path" in result.output
    result = CliRunner().invoke(_app(), ["bench", "--model", "Qwen3-30B-A3B", "--model", "nope"])
    assert result.exit_code == 2 and "unknown model" in result.output


def test_step_count_matches_the_progress_calls():
    cfg = BenchConfig.quick(shapes=QUICK_SHAPES[:1], paths=("naive", "liger"), memory_tokens=(32,), repeats=2)
    labels: list[str] = []
    run_benchmark(cfg, labels.append)
    # 1 shape x (reference + matmul + 2 path warm-ups + 2 rounds + errors), 1 sweep point x 2 paths, naive at 1024
    assert len(labels) == count_steps(cfg) == 1 * (1 + 1 + 2 + 2 + 1) + 1 * 2 + 1
    assert count_steps(BenchConfig.quick(paths=("naive",), memory_tokens=())) == 2 * (1 + 1 + 1 + 3 + 1)
