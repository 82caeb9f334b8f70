"""``nemo-is diagnose`` end to end, through the installed entry point (a subprocess, as a user runs it).

1. On the dump written by the main job (``nemo-is demo --quick``, the run shared with test_demo.py).
2. On a synthetic dump with a realistic mismatch (always runs): the table is printed and both plots are written.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from nemo_is_plugin.apps.diagnose import synthetic_records, write_dump

PNG = b"\x89PNG\r\n\x1a\n"
CLI = [sys.executable, "-m", "nemo_is_plugin.apps.cli.main"]
ENV = dict(os.environ, OMP_NUM_THREADS="1", COLUMNS="200")


def _run(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout, env=ENV)


def _check_diagnose(dump: Path, out: Path) -> dict:
    res = _run("diagnose", str(dump), "--out", str(out), "--json", str(out / "report.json"))
    assert res.returncode == 0, res.stdout + res.stderr
    text = res.stdout
    for title in (
        "Training/rollout mismatch by response length",
        "IS weights per setting",
        "IS weights by response length",
        "recommendation",
        "loss_fn:",
    ):
        assert title in text, text
    for png in ("diagnose_weights_vs_length.png", "diagnose_bins.png"):
        assert (out / png).read_bytes()[:8] == PNG
        assert (out / png).stat().st_size > 10_000
    return json.loads((out / "report.json").read_text())


def test_diagnose_on_a_dump_from_the_demo(demo_quick_run, tmp_path):
    assert (demo_quick_run / "rollouts.jsonl").is_file(), sorted(p.name for p in demo_quick_run.iterdir())
    report = _check_diagnose(demo_quick_run, tmp_path / "diag")  # a run directory is accepted as is
    assert report["num_responses"] > 0


def test_diagnose_on_a_synthetic_dump(tmp_path):
    dump = write_dump(
        synthetic_records(48, min_len=8, max_len=2048, mismatch_std=0.02, steps=2, seed=11),
        tmp_path / "rollouts.parquet",
    )
    report = _check_diagnose(Path(dump), tmp_path / "diag")
    assert report["num_responses"] == 48
    rec = report["recommendation"]
    assert rec["name"] in report["settings"] and rec["loss_fn"]["use_importance_sampling_correction"] is True
    # the sequence weight degrades with length on this dump: its ESS in the longest bin is below the shortest's
    seq = report["settings"]["sequence"]["by_bin"]
    bins = report["bins"]
    assert seq[bins[-1]]["ess"] < seq[bins[0]]["ess"]
