"""tools/bench_docs: the docs writers live in the repository's tooling, not in the installed package, and
``python -m tools.bench_docs`` answers a bad argument with one line and exit 2 (its pages are tested from hand-written
results in tests/apps/bench: test_bench_gpu_report.py, test_host_heads_bench.py, test_bench_cli.py)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import nemo_is_plugin
from tools.bench_docs.__main__ import main

ROOT = Path(__file__).resolve().parents[2]


def test_the_package_holds_no_docs_writer():
    assert importlib.util.find_spec("nemo_is_plugin.apps.bench.docs") is None
    assert importlib.util.find_spec("nemo_is_plugin.apps.bench.gpu_docs") is None
    package = Path(nemo_is_plugin.__file__).parent
    writers = [p for p in package.rglob("*.py") if "performance.md" in p.read_text() and "write_text" in p.read_text()]
    assert writers == [], writers


def test_bad_arguments_are_one_line_and_exit_2(tmp_path, capsys):
    assert main(["head", str(tmp_path / "missing.json")]) == 2
    assert "no such file" in capsys.readouterr().err
    results, docs = tmp_path / "r.json", tmp_path / "docs"
    results.write_text(json.dumps({"config": {"device": "cpu"}}))
    docs.write_text("")
    assert main(["head", str(results), "--docs-dir", str(docs)]) == 2
    assert "is a file" in capsys.readouterr().err
    assert main(["model-step", str(results), "--docs-dir", str(tmp_path / "d")]) == 2  # not a GPU run
    assert "real GPU run" in capsys.readouterr().err and not (tmp_path / "d").exists()


def test_runs_as_a_module_from_the_repository_root(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "tools.bench_docs", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0 and "cpu,head,model-step,host-heads" in done.stdout
