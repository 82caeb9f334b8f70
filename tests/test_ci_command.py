"""The CI command: `.ci/run` is `make test`, which lints, formats and type-checks before the test suite."""

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


def test_make_test_lints_then_runs_the_suite():
    prerequisites, recipe = _rule("test")
    assert prerequisites == ["setup", "lint"]  # make builds prerequisites first, left to right
    assert len(recipe) == 1 and "-m pytest" in recipe[0]
    lint_prerequisites, lint = _rule("lint")
    assert lint_prerequisites == ["setup"]
    assert lint == ["$(VENV)/bin/ruff check .", "$(VENV)/bin/ruff format --check .", "$(VENV)/bin/mypy"]
