"""The CI command: `.ci/run` runs `make test`, which sets up the environment, then lints, formats and type-checks,
then runs the test suite. Checked on what make would run (`make -n`, a dry run), not on the Makefile's text."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")


def _dry_run(target: str, venv: Path) -> list[str]:
    """The commands `make <target>` would run, in order (recipe comments dropped), with the environment at ``venv``."""
    out = subprocess.run(
        ["make", "-n", "--no-print-directory", "-C", str(ROOT), target, f"VENV={venv}", "PYTHON=python3"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return [line.strip() for line in out.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def test_ci_runs_make_test(tmp_path):
    """`.ci/run` with a `make` that records its arguments: it is called once, with `test`, from the repository root."""
    fake = tmp_path / "bin" / "make"
    fake.parent.mkdir()
    fake.write_text(f'#!/usr/bin/env bash\necho "$PWD $*" >> {tmp_path / "calls"}\n')
    fake.chmod(0o755)
    env = dict(os.environ, PATH=f"{fake.parent}{os.pathsep}{os.environ['PATH']}")
    subprocess.run(["bash", str(ROOT / ".ci" / "run")], cwd=tmp_path, env=env, check=True)
    assert (tmp_path / "calls").read_text().splitlines() == [f"{ROOT} test"]


def test_make_test_sets_up_then_lints_then_runs_the_whole_suite(tmp_path):
    venv = tmp_path / "venv"
    commands = _dry_run("test", venv)
    checks = [
        f"{venv}/bin/ruff check .",
        f"{venv}/bin/ruff format --check .",
        f"{venv}/bin/mypy",
        f"OMP_NUM_THREADS=1 {venv}/bin/python -m pytest -q tests functional_tests",
    ]
    assert commands[-4:] == checks
    setup = commands[:-4]
    assert setup[0] == f"test -x {venv}/bin/python || python3 -m venv {venv}"
    assert f"{venv}/bin/python -m pip install -q --no-deps -r requirements/ci.lock" in setup
    assert setup[-3] == f"{venv}/bin/python -m pip install -q --no-deps --no-build-isolation -e ."
    assert setup[-1].startswith(f"touch {venv}/.installed-")


def test_a_second_make_test_skips_the_setup(tmp_path):
    """Once the environment's stamp is newer than pyproject.toml and the lock, `make test` only checks and tests."""
    venv = tmp_path / "venv"
    stamp = Path(_dry_run("test", venv)[-5].removeprefix("touch "))
    stamp.parent.mkdir(parents=True)
    stamp.touch()
    assert _dry_run("test", venv) == [
        f"{venv}/bin/ruff check .",
        f"{venv}/bin/ruff format --check .",
        f"{venv}/bin/mypy",
        f"OMP_NUM_THREADS=1 {venv}/bin/python -m pytest -q tests functional_tests",
    ]
