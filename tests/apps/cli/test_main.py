"""The ``nemo-is`` app: --version, and help texts whose on/off flags read well (no ``<bool>``, no ``--no-no-``)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import typer.main
from typer.testing import CliRunner

import nemo_is_plugin
from nemo_is_plugin.apps.cli.main import COMMAND_MODULES, app


def _help(*args: str) -> str:
    result = CliRunner().invoke(app, [*args, "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    return result.output


def test_version():
    result = CliRunner().invoke(app, ["--version"])
    assert result.exit_code == 0 and result.output == f"nemo-is-plugin {nemo_is_plugin.__version__}\n"


@pytest.mark.parametrize("command", [(), *[(c,) for c in COMMAND_MODULES]], ids=lambda c: c[0] if c else "root")
def test_flags_read_well(command):
    text = _help(*command)
    assert "<bool>" not in text and "--no-no-" not in text
    assert not re.search(r"\[default: no-", text)  # a one-sided flag has no "no-" default to show


def test_every_flag_is_one_sided():
    """``--quick`` / ``--json`` / ``--detail`` ...: a flag switches something on; no generated ``--no-`` twin."""
    root = typer.main.get_command(app)
    for name, cmd in root.commands.items():
        for p in cmd.params:
            if getattr(p, "is_flag", False) and p.name != "help":
                assert not p.secondary_opts, (name, p.opts, p.secondary_opts)


def test_evidence_writes_under_the_working_directory_by_default():
    cmd = typer.main.get_command(app).commands["evidence"]
    (out,) = [p for p in cmd.params if p.name == "output_dir"]
    assert Path(out.default) == Path("runs/evidence")
