"""``nemo-is``: the plugin's command line (typer). Each command lives in its own module with ``register(app)``;
heavy imports (torch, megatron, ray) happen inside the commands, so ``nemo-is --help`` is fast."""

from __future__ import annotations

import importlib

import typer

app = typer.Typer(
    name="nemo-is",
    help="Importance-sampling-corrected policy-gradient losses: validate configs, run the demo, diagnose, benchmark.",
    no_args_is_help=True,
    add_completion=False,
)



@app.callback()
def _root() -> None:
    """Keeps ``nemo-is`` a command group even while only one command is registered."""


COMMAND_MODULES = ("validate", "demo", "diagnose", "bench", "evidence")

for _name in COMMAND_MODULES:
    importlib.import_module(f"nemo_is_plugin.cli.{_name}").register(app)


def main() -> None:  # pragma: no cover - console entry
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
