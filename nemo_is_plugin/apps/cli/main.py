"""``nemo-is``: the plugin's command line (typer). Each command lives in its own module with ``register(app)``;
heavy imports (torch, megatron, ray) happen inside the commands, so ``nemo-is --help`` is fast."""

from __future__ import annotations

import importlib
from typing import Any

import typer
from typer.core import TyperCommand, TyperGroup


def _plain_flags(params: list[Any]) -> list[Any]:
    """Help without a ``<bool>`` placeholder after on/off flags (``--help`` included): a flag takes no value."""
    for p in params:
        if getattr(p, "is_flag", False) and p.metavar is None:
            p.metavar = ""
    return params


class _Group(TyperGroup):
    def get_params(self, ctx):
        return _plain_flags(super().get_params(ctx))


class _Command(TyperCommand):
    def get_params(self, ctx):
        return _plain_flags(super().get_params(ctx))


app = typer.Typer(
    name="nemo-is",
    help="Importance-sampling-corrected policy-gradient losses: validate configs, run the demo, diagnose, benchmark.",
    no_args_is_help=True,
    add_completion=False,
    cls=_Group,
)


def _version(value: bool) -> None:
    if value:
        from nemo_is_plugin import __version__

        typer.echo(f"nemo-is-plugin {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool | None = typer.Option(
        None, "--version", callback=_version, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    """Keeps ``nemo-is`` a command group even while only one command is registered."""


COMMAND_MODULES = ("validate", "compat", "demo", "diagnose", "bench", "evidence")

for _name in COMMAND_MODULES:
    importlib.import_module(f"nemo_is_plugin.apps.cli.{_name}").register(app)
for _info in app.registered_commands:  # every command's help renders flags without a value placeholder
    if _info.cls in (None, TyperCommand):
        _info.cls = _Command


def main() -> None:  # pragma: no cover - console entry
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
