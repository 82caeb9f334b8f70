"""``nemo-is diagnose`` through typer's runner: tables, plots, JSON, filters, and clean errors (exit 2, no traceback)."""

from __future__ import annotations

import json

import pytest
import typer
from typer.testing import CliRunner

from nemo_is_plugin.cli.diagnose import register
from nemo_is_plugin.diagnose import diagnose, synthetic_records, write_dump

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def app():
    app = typer.Typer()
    register(app)

    @app.callback()
    def _root() -> None:  # keep a command group, as cli/main.py does
        """test app"""

    return app


@pytest.fixture(scope="module")
def dump_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("run") / "rollouts.jsonl"
    recs = synthetic_records(24, min_len=4, max_len=300, mismatch_std=0.02, steps=2, configs=["x", "y"], seed=5)
    return write_dump(recs, path)


def invoke(app, *args):
    return CliRunner().invoke(app, ["diagnose", *map(str, args)], env={"COLUMNS": "200"})


def test_diagnose_prints_tables_and_writes_plots_and_json(app, dump_path, tmp_path):
    out = tmp_path / "plots"
    res = invoke(app, dump_path, "--out", out, "--json", tmp_path / "r.json", "--truncations", "none,tis")
    assert res.exit_code == 0, res.output
    for title in ("Training/rollout mismatch by response length", "IS weights per setting",
                  "IS weights by response length", "recommendation", "loss_fn:"):
        assert title in res.output
    for name in ("token+tis[0,2]", "sequence_mean", "cumulative+tis[0,2]"):
        assert name in res.output
    pngs = sorted(p.name for p in out.iterdir())
    assert pngs == ["diagnose_bins.png", "diagnose_weights_vs_length.png"]
    assert all((out / p).read_bytes()[:8] == PNG and (out / p).stat().st_size > 10_000 for p in pngs)
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["num_responses"] == 24
    assert set(report["settings"]) == {f"{lv}{t}" for lv in ("token", "sequence", "sequence_mean", "cumulative")
                                       for t in ("", "+tis[0,2]")}
    assert report["recommendation"]["name"] in report["settings"]
    # the JSON holds the same numbers as the Python API
    api = diagnose(dump_path, truncations=("none", "tis"))
    assert report["settings"]["token"]["overall"]["mean"] == pytest.approx(api.analysis.result("token").overall.mean)


def test_default_plot_directory_is_next_to_the_dump(app, dump_path):
    res = invoke(app, dump_path, "--levels", "token", "--truncations", "none")
    assert res.exit_code == 0, res.output
    assert f"wrote {dump_path.rsplit('/', 1)[0]}/diagnose/diagnose_bins.png" in res.output.replace("\n", "")


def test_filters_and_detail(app, dump_path):
    res = invoke(app, dump_path, "--no-plots", "--step", 1, "--config", "x", "--levels", "sequence", "--detail",
                 "--bins", "16,64")
    assert res.exit_code == 0, res.output
    report = diagnose(dump_path, steps=[1], config="x", levels=("sequence",))
    assert f"{report.analysis.num_responses} responses" in res.output
    assert "sequence: weights by response length" in res.output  # --detail table
    assert "wrote" not in res.output


@pytest.mark.parametrize(("args", "message"), [
    (["missing.jsonl"], "no such file"),
    (["{dump}", "--step", "99"], "no response matches steps=[99]"),
    (["{dump}", "--levels", "prefix"], "unknown IS level 'prefix'"),
    (["{dump}", "--truncations", "clip"], "unknown truncation 'clip'"),
    (["{dump}", "--dtype", "float16"], "dtype must be one of float32, float64"),
    (["{dump}", "--levels", "sequence", "--truncations", "seq-mask-tis"], "no valid setting to diagnose"),
    (["{dump}", "--tis-high", "-1", "--truncations", "tis", "--levels", "token"], "no valid setting to diagnose"),
])
def test_bad_input_exits_2_with_a_message(app, dump_path, tmp_path, args, message):
    args = [a.replace("{dump}", str(dump_path)) for a in args]
    if args[0] == "missing.jsonl":
        args[0] = str(tmp_path / "missing.jsonl")
    res = invoke(app, *args)
    assert res.exit_code == 2, res.output
    assert "error:" in res.output and message in res.output.replace("\n", "")
    assert "Traceback" not in res.output
    assert res.exception is None or isinstance(res.exception, SystemExit)


def test_malformed_dump_exits_2(app, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"generation_logprobs": [-1.0], "prev_logprobs": [0.7]}\n')
    res = invoke(app, bad)
    assert res.exit_code == 2
    assert "line 1: 'prev_logprobs' token 0 is 0.7 > 0.001" in res.output.replace("\n", "")


def test_bad_option_value_is_a_usage_error(app, dump_path):
    res = invoke(app, dump_path, "--icepop", "a,b")
    assert res.exit_code == 2 and "--icepop expects 2 comma-separated numbers" in res.output


def test_main_app_registers_diagnose():
    from nemo_is_plugin.cli.main import app as main_app

    res = CliRunner().invoke(main_app, ["diagnose", "--help"])
    assert res.exit_code == 0 and "Diagnose the training/rollout mismatch" in res.output
