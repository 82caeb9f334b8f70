"""``nemo-is diagnose`` via typer's runner: tables, plots, JSON, filters, and clean errors (exit 2, no traceback)."""

from __future__ import annotations

import json
import math
import re

import pytest
import typer
from typer.testing import CliRunner

from nemo_is_plugin.apps.cli.diagnose import register
from nemo_is_plugin.apps.diagnose import diagnose, synthetic_records, write_dump

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
    for title in (
        "Training/rollout mismatch by response length",
        "IS weights per setting",
        "IS weights by response length",
        "recommendation",
        "loss_fn:",
    ):
        assert title in res.output
    for name in ("token+tis[0,2]", "sequence_mean", "cumulative+tis[0,2]"):
        assert name in res.output
    pngs = sorted(p.name for p in out.iterdir())
    assert pngs == ["diagnose_bins.png", "diagnose_weights_vs_length.png"]
    assert all((out / p).read_bytes()[:8] == PNG and (out / p).stat().st_size > 10_000 for p in pngs)
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["num_responses"] == 24
    assert set(report["settings"]) == {
        f"{lv}{t}" for lv in ("token", "sequence", "sequence_mean", "cumulative") for t in ("", "+tis[0,2]")
    }
    assert report["recommendation"]["name"] in report["settings"]
    # the JSON holds the same numbers as the Python API
    api = diagnose(dump_path, truncations=("none", "tis"))
    assert report["settings"]["token"]["overall"]["mean"] == pytest.approx(api.analysis.result("token").overall.mean)


def test_default_plot_directory_is_next_to_the_dump(app, dump_path):
    res = invoke(app, dump_path, "--levels", "token", "--truncations", "none")
    assert res.exit_code == 0, res.output
    assert f"wrote {dump_path.rsplit('/', 1)[0]}/diagnose/diagnose_bins.png" in res.output.replace("\n", "")


def test_filters_and_detail(app, dump_path):
    res = invoke(
        app,
        dump_path,
        "--no-plots",
        "--step",
        1,
        "--config",
        "x",
        "--levels",
        "sequence",
        "--detail",
        "--bins",
        "16,64",
    )
    assert res.exit_code == 0, res.output
    report = diagnose(dump_path, steps=[1], config="x", levels=("sequence",))
    assert f"{report.analysis.num_responses} responses" in res.output
    assert "sequence: weights by response length" in res.output  # --detail table
    assert "wrote" not in res.output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["missing.jsonl"], "no such file"),
        (["{dump}", "--step", "99"], "no response matches steps=[99]"),
        (["{dump}", "--levels", "prefix"], "unknown IS level 'prefix'"),
        (["{dump}", "--truncations", "clip"], "unknown truncation 'clip'"),
        (["{dump}", "--dtype", "float16"], "dtype must be one of float32, float64"),
        (["{dump}", "--levels", "sequence", "--truncations", "seq-mask-tis"], "no valid setting to diagnose"),
        (["{dump}", "--tis-high", "-1", "--truncations", "tis", "--levels", "token"], "no valid setting to diagnose"),
    ],
)
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
    from nemo_is_plugin.apps.cli.main import app as main_app

    res = CliRunner().invoke(main_app, ["diagnose", "--help"])
    assert res.exit_code == 0 and "Diagnose the training/rollout mismatch" in res.output


# ------------------------------------------------------------------ write-config, plain text, labels, small samples
def test_write_config_writes_a_ready_to_use_loss_fn_section(app, dump_path, tmp_path):
    from omegaconf import OmegaConf

    import nemo_is_plugin
    from nemo_is_plugin.adapters.recipes import load_loss_spec

    target = tmp_path / "cfg" / "recommended.yaml"
    res = invoke(app, dump_path, "--no-plots", "--write-config", target, "--truncations", "none,tis")
    assert res.exit_code == 0, res.output
    rec = diagnose(dump_path, truncations=("none", "tis")).recommendation
    spec = load_loss_spec(target)
    assert spec.config.model_dump(exclude_defaults=True) == rec.loss_fn
    loss = nemo_is_plugin.build_loss_fn(OmegaConf.load(target)["loss_fn"])
    assert loss.config == spec.config
    # the same section is printed as plain text (no box characters), ready to copy
    plain = rec.yaml().rstrip().splitlines()
    lines = res.output.splitlines()
    start = lines.index(plain[0])
    assert lines[start : start + len(plain)] == plain and not any("│" in ln for ln in plain)


def test_a_bad_output_path_is_refused_before_anything_is_written(app, dump_path, tmp_path):
    out = tmp_path / "plots"
    res = invoke(app, dump_path, "--out", out, "--write-config", tmp_path)
    assert res.exit_code == 2 and "is a folder; give a file path" in res.output
    assert not out.exists()


def test_corrupt_gzip_exits_2_and_writes_nothing(app, tmp_path):
    bad = tmp_path / "g.jsonl.gz"
    bad.write_bytes(b"\x1f\x8b\x08\x00garbagegarbage")
    res = invoke(app, bad, "--json", tmp_path / "r.json", "--write-config", tmp_path / "c.yaml")
    assert res.exit_code == 2 and "corrupt gzip data" in res.output and "Traceback" not in res.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["g.jsonl.gz"]


def test_header_labels_total_and_valid_tokens(app, tmp_path):
    recs = synthetic_records(40, min_len=4, max_len=60, seed=2)
    for r in recs:  # mask the last token of every response
        r["mask"] = [1] * (len(r["generation_logprobs"]) - 1) + [0]
    path = write_dump(recs, tmp_path / "m.jsonl")
    res = invoke(app, path, "--no-plots", "--levels", "token", "--truncations", "none")
    total = sum(len(r["mask"]) for r in recs)
    assert f"40 responses, {total} tokens of which {total - 40} are valid" in res.output.replace("\n", " ")
    assert "valid tokens" in res.output  # the mismatch table's column
    assert re.search(rf"│ all\s+│\s+40 │\s+{total - 40} │", res.output)  # its "all" row counts valid tokens


def test_small_sample_warns_and_says_tentative(app, tmp_path):
    small = write_dump(synthetic_records(3, min_len=4, max_len=30, seed=1), tmp_path / "small.jsonl")
    res = invoke(app, small, "--no-plots", "--json", tmp_path / "r.json")
    assert res.exit_code == 0, res.output
    assert "tentative: small sample" in res.output and "only 3 response(s) with a valid token" in res.output
    assert json.loads((tmp_path / "r.json").read_text())["recommendation"]["warnings"]
    big = write_dump(synthetic_records(32, min_len=4, max_len=30, seed=1), tmp_path / "big.jsonl")
    res = invoke(app, big, "--no-plots")
    assert res.exit_code == 0 and "tentative" not in res.output


def test_a_negative_chi2_estimate_is_marked_and_explained(app, tmp_path):
    # every token has p - g = -0.1: w = exp(-0.1) < 1, so E[w^2] - 1 < 0 for tokens and sequences
    recs = [{"generation_logprobs": [-1.0] * 5, "prev_logprobs": [-1.1] * 5} for _ in range(4)]
    path = write_dump(recs, tmp_path / "neg.jsonl")
    res = invoke(app, path, "--no-plots", "--levels", "token", "--truncations", "none")
    out = res.output.replace("\n", " ")
    assert f"{math.exp(-0.2) - 1:.3g}*" in out
    assert "* a chi-square estimate E[w^2] - 1 below 0, while the divergence itself is >= 0" in out
