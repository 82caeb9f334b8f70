"""Every command's file and folder options: a path the command cannot use ends it with one line naming the option and
exit status 2, before any work (Ray, a sweep, a benchmark) starts -- never a traceback
(nemo_is_plugin/apps/cli/paths.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from nemo_is_plugin.apps.cli import demo as demo_cli
from nemo_is_plugin.apps.cli.main import app
from nemo_is_plugin.apps.cli.paths import PathError, check_path


@pytest.fixture
def places(tmp_path: Path) -> dict[str, Path]:
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    empty = tmp_path / "empty_dir"
    empty.mkdir()
    return {"file": a_file, "dir": empty, "missing": tmp_path / "missing", "under_file": a_file / "sub"}


# (command line with {file} / {dir} / {missing} / {under_file}, the command's name, what the line must say)
CASES = [
    (["evidence", "-o", "{file}"], "evidence", "--output-dir {file} is a file"),
    (["evidence", "-o", "{under_file}"], "evidence", "{file} is a file, not a folder"),
    (["demo", "--output-dir", "{file}"], "demo", "--output-dir {file} is a file"),
    (["demo", "--plot-only", "--output-dir", "{missing}"], "demo", "--output-dir {missing}: no such folder"),
    (["demo", "--plot-only", "--output-dir", "{file}"], "demo", "--output-dir {file}: not a folder"),
    (["demo", "--plot-only", "--output-dir", "{dir}"], "demo", "{dir} holds no metrics.jsonl"),
    (["diagnose", "{missing}", "--json", "{dir}"], "diagnose", "--json {dir} is a folder; give a file path"),
    (["diagnose", "{missing}", "--write-config", "{dir}"], "diagnose", "--write-config {dir} is a folder"),
    (["diagnose", "{missing}", "--out", "{file}"], "diagnose", "--out {file} is a file"),
    (["compat", "{missing}"], "compat", "CONFIG {missing}: no such file"),
    (["compat", "{dir}"], "compat", "CONFIG {dir}: a folder, not a file"),
    (["compat", "{file}", "--json", "{dir}"], "compat", "--json {dir} is a folder"),
    (["bench", "--out", "{file}"], "bench", "--out {file} is a file"),
    (["bench", "--from-json", "{missing}"], "bench", "--from-json {missing}: no such file"),
    (["bench", "--model-step", "--out", "{under_file}"], "bench", "{file} is a file, not a folder"),
]


@pytest.mark.parametrize("argv, command, says", CASES, ids=[" ".join(c[0]) for c in CASES])
def test_an_unusable_path_is_one_line_and_exit_2(places, monkeypatch, argv, command, says):
    def no_run(*args, **kwargs):
        raise AssertionError("the demo started (Ray) before its output folder was checked")

    monkeypatch.setattr(demo_cli, "_run", no_run)
    fill = {k: str(v) for k, v in places.items()}
    result = CliRunner().invoke(app, [a.format(**fill) for a in argv])
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and not isinstance(result.exception, AssertionError)
    lines = result.output.strip().splitlines()
    assert lines == [lines[0]] and lines[0].startswith(f"nemo-is {command}: "), result.output
    assert says.format(**fill) in lines[0]


def test_nothing_is_created_for_a_refused_command(places):
    out = places["missing"] / "plots"
    result = CliRunner().invoke(
        app, ["diagnose", str(places["missing"]), "--out", str(out), "--json", str(places["dir"])]
    )
    assert result.exit_code == 2 and not out.exists()


def test_check_path_kinds(places):
    check_path(places["missing"] / "deeper" / "x.json", "--json", "output_file")  # parents are created later
    check_path(places["dir"], "--out", "output_dir")
    check_path(places["file"], "--json", "output_file")  # replaced
    check_path(None, "--json", "output_file")  # an unset option
    for path, kind, says in (
        (places["file"], "output_dir", "is a file"),
        (places["dir"], "output_file", "is a folder"),
        (places["under_file"], "output_file", "is a file, not a folder"),
        (places["missing"], "input_file", "no such file"),
        (places["missing"], "input_dir", "no such folder"),
    ):
        with pytest.raises(PathError, match=says):
            check_path(path, "--opt", kind)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_a_read_only_parent_is_refused(places):
    places["dir"].chmod(0o500)
    try:
        with pytest.raises(PathError, match="cannot write in"):
            check_path(places["dir"] / "out" / "x.json", "--json", "output_file")
    finally:
        places["dir"].chmod(0o700)
