"""The CI command: `.ci/run` is `make test`, which lints, formats and type-checks before the test suite, then runs
the hosts' stacks tier (Python 3.13, `make test-stacks`)."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _rule(target: str) -> tuple[list[str], list[str]]:
    """(prerequisites, recipe lines) of a Makefile target."""
    text = ROOT.joinpath("Makefile").read_text()
    match = re.search(rf"^{target}:(.*)\n((?:\t.*\n)*)", text, flags=re.MULTILINE)
    assert match is not None, f"the Makefile has no {target!r} target"
    return match.group(1).split(), [line.strip() for line in match.group(2).splitlines()]


def test_ci_runs_make_test():
    lines = [ln for ln in ROOT.joinpath(".ci/run").read_text().splitlines() if ln and not ln.startswith("#")]
    assert lines[-1] == "make test"


def test_make_test_lints_then_runs_the_suite_then_the_stacks_tier():
    prerequisites, recipe = _rule("test")
    assert prerequisites == ["setup", "lint"]  # make builds prerequisites first, left to right
    assert len(recipe) == 2 and "$(PY) -m pytest" in recipe[0] and recipe[1] == "$(MAKE) test-stacks"
    stacks_prerequisites, stacks = _rule("test-stacks")
    assert stacks_prerequisites == ["setup-stacks"] and stacks == [
        "OMP_NUM_THREADS=1 $(PY_STACKS) -m pytest -q $(STACKS_TESTS)"
    ]
    lint_prerequisites, lint = _rule("lint")
    assert lint_prerequisites == ["setup"]
    assert lint == ["$(VENV)/bin/ruff check .", "$(VENV)/bin/ruff format --check .", "$(VENV)/bin/mypy"]


def test_the_stacks_tier_selects_the_host_groups_by_existing_paths():
    """`make test-stacks` names its test groups explicitly (docs/testing.md): each path exists (a rename cannot drop a
    group silently), and the golden, loss, config, kernel, distributed, adapter, bad-input and guard tests are in."""
    text = ROOT.joinpath("Makefile").read_text()
    match = re.search(r"^STACKS_TESTS := ((?:.*\\\n)*.*)$", text, flags=re.MULTILINE)
    assert match is not None, "the Makefile has no STACKS_TESTS"
    paths = match.group(1).replace("\\\n", " ").split()
    assert [p for p in paths if not ROOT.joinpath(p).exists()] == []
    golden = sorted(str(p.relative_to(ROOT)) for p in ROOT.joinpath("tests").glob("test_golden_*.py"))
    groups = ["tests/loss", "tests/config", "tests/kernels", "tests/distributed", "tests/adapters"]
    assert set(golden + groups + ["tests/test_bad_inputs.py", "tests/test_device_guard.py"]) <= set(paths)
