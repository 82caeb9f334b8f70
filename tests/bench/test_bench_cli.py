"""``nemo-is bench`` end to end on tiny shapes: table printed, JSON + PNG written, docs regenerated."""

from __future__ import annotations

import json

import typer
from typer.testing import CliRunner

from nemo_is_plugin.bench.runner import count_steps
from nemo_is_plugin.bench.shapes import BenchConfig
from nemo_is_plugin.cli.bench import register


def _app() -> typer.Typer:
    app = typer.Typer()

    @app.callback()
    def _root() -> None:  # keep "bench" a subcommand
        pass

    register(app)
    return app


def test_quick_bench_writes_results_plots_and_docs(tmp_path):
    out, docs = tmp_path / "out", tmp_path / "docs"
    args = ["bench", "--quick", "--model", "tiny-a", "--path", "naive", "--path", "fused_linear",
            "--memory-tokens", "32", "--memory-tokens", "64", "--out", str(out), "--write-docs", "--docs-dir", str(docs)]
    result = CliRunner().invoke(_app(), args)
    assert result.exit_code == 0, result.output
    assert "fused_linear" in result.output and "f+b / mm" in result.output and "tiny-b" not in result.output

    results = json.loads((out / "results.json").read_text())
    rows = {(r["model"], r["path"]): r for r in results["rows"]}
    assert {p for _, p in rows} == {"matmul", "naive", "fused_linear", "loss"}
    for model in ("tiny-a",):
        fused = rows[(model, "fused_linear")]
        assert fused["lp_err"] < 1e-5 and fused["grad_err"] < 1e-5
        assert fused["fwd_s"] > 0 and fused["fwdbwd_s"] > fused["fwd_s"]
        # one 16-token chunk of fp32 logits vs the naive path's [64, V] logits + log-softmax
        assert fused["fwd_peak"] < rows[(model, "naive")]["fwd_peak"] / 3
    assert {p["tokens"] for p in results["memory_sweep"]} == {32, 64}
    for name in ("perf_ratios.png", "perf_memory.png"):
        assert (out / name).stat().st_size > 1000 and (docs / "img" / name).stat().st_size > 1000
    page = (docs / "performance.md").read_text()
    assert "## Targets" in page and "| tiny-a | 64 | fused_linear |" in page

    # re-rendering a saved run measures nothing and reproduces the page
    (docs / "performance.md").unlink()
    again = CliRunner().invoke(_app(), ["bench", "--from-json", str(out / "results.json"), "--out",
                                        str(tmp_path / "out2"), "--write-docs", "--docs-dir", str(docs)])
    assert again.exit_code == 0, again.output
    assert (docs / "performance.md").read_text() == page


def test_unknown_path_or_model_is_a_usage_error():
    result = CliRunner().invoke(_app(), ["bench", "--quick", "--path", "bogus"])
    assert result.exit_code == 2 and "unknown path" in result.output
    result = CliRunner().invoke(_app(), ["bench", "--model", "Qwen3-30B-A3B", "--model", "nope"])
    assert result.exit_code == 2 and "unknown model" in result.output


def test_step_count_matches_the_plan():
    cfg = BenchConfig.quick(paths=("naive", "liger"), memory_tokens=(32,), repeats=3)
    assert count_steps(cfg) == 2 * (1 + 2 + 3 + 1) + 1 * 2
