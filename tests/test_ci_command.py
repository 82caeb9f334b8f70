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
    """The commands `make <target>` would run, in order (recipe comments dropped), with the environment at ``venv``
    and the stacks tier's at ``venv``-313 (fresh paths: a checkout's own venvs would make make skip their setup)."""
    out = subprocess.run(
        [
            "make",
            "-n",
            "--no-print-directory",
            "-C",
            str(ROOT),
            target,
            f"VENV={venv}",
            f"VENV_STACKS={venv}-313",
            "PYTHON=python3",
        ],
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


MAIN_CHECKS = ["ruff check .", "ruff format --check .", "mypy"]


def _main_tier(commands: list[str], venv: Path) -> list[str]:
    """The commands of `make test` up to the recursive `make test-stacks` (which a dry run also expands)."""
    assert "make test-stacks" in commands, commands
    return commands[: commands.index("make test-stacks")]


def test_make_test_sets_up_then_lints_then_runs_the_whole_suite_then_the_stacks_tier(tmp_path):
    venv = tmp_path / "venv"
    commands = _dry_run("test", venv)
    main = _main_tier(commands, venv)
    checks = [
        *(f"{venv}/bin/{c}" for c in MAIN_CHECKS),
        f"OMP_NUM_THREADS=1 {venv}/bin/python -m pytest -q tests functional_tests",
    ]
    assert main[-4:] == checks
    setup = main[:-4]
    assert setup[0] == f"test -x {venv}/bin/python || python3 -m venv {venv}"
    assert f"{venv}/bin/python -m pip install -q --no-deps -r requirements/ci.lock" in setup
    editable = f"{venv}/bin/python -m pip install -q --no-deps --no-build-isolation -e"
    # the project, then the example objective package: the whole suite runs with another package's objective installed
    assert setup[-4:-2] == [f"{editable} .", f"{editable} examples/tapered_reinforce"]
    assert setup[-1].startswith(f"touch {venv}/.installed-")
    stacks = commands[len(main) + 1 :]
    assert stacks[-1].startswith(f"OMP_NUM_THREADS=1 {venv}-313/bin/python -m pytest -q tests/")
    assert f"{venv}-313/bin/python -m pip install -q --no-deps -r requirements/ci-py313.lock" in stacks


def test_a_second_make_test_skips_the_setup(tmp_path):
    """Once the environment's stamp is newer than pyproject.toml and the lock, `make test` only checks and tests."""
    venv = tmp_path / "venv"
    stamp = Path(_main_tier(_dry_run("test", venv), venv)[-5].removeprefix("touch "))
    stamp.parent.mkdir(parents=True)
    stamp.touch()
    assert _main_tier(_dry_run("test", venv), venv) == [
        *(f"{venv}/bin/{c}" for c in MAIN_CHECKS),
        f"OMP_NUM_THREADS=1 {venv}/bin/python -m pytest -q tests functional_tests",
    ]


def test_the_stacks_tier_selects_the_host_groups_by_existing_paths(tmp_path):
    """`make test-stacks` names its test groups explicitly (docs/testing.md): each path exists (a rename cannot drop a
    group silently), and the golden, loss, config, kernel, distributed, adapter, bad-input and guard tests are in."""
    pytest_line = _dry_run("test-stacks", tmp_path / "venv")[-1]
    paths = pytest_line.split(" -m pytest -q ", 1)[1].split()
    assert [p for p in paths if not ROOT.joinpath(p).exists()] == []
    golden = sorted(str(p.relative_to(ROOT)) for p in ROOT.joinpath("tests").glob("test_golden_*.py"))
    groups = ["tests/common", "tests/loss", "tests/config", "tests/kernels", "tests/distributed", "tests/adapters"]
    assert set(golden + groups + ["tests/test_bad_inputs.py", "tests/test_device_guard.py"]) <= set(paths)
