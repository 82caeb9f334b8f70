"""The ``nemo-is`` command line: one module per command, each exposing ``register(app)``.

``run`` is the console script. The command line's packages are an extra (``pip install 'nemo-is-plugin[cli]'``), not
part of what a trainer installs with the loss, so ``run`` imports the typer app only when called and answers a
missing one with the extra that brings it instead of a traceback.
"""

from __future__ import annotations

import sys

# The top-level modules the optional extras bring, and the extra to install for each.
EXTRA_OF_MODULE = {
    "typer": "cli",
    "click": "cli",
    "rich": "cli",
    "matplotlib": "cli",
    "pyarrow": "cli",
    "megatron": "megatron",
    "ray": "demo",
}


def missing_extra(exc: BaseException) -> str | None:
    """The extra whose absence raised ``exc``; None when ``exc`` is not a missing module that an extra brings."""
    if not isinstance(exc, ModuleNotFoundError) or not exc.name:
        return None
    return EXTRA_OF_MODULE.get(exc.name.split(".")[0])


def run() -> None:
    """Run ``nemo-is``; exit with status 1 and a one-line message when a package of an extra is not installed."""
    try:
        from nemo_is_plugin.cli.main import app

        app()
    except ModuleNotFoundError as exc:
        extra = missing_extra(exc)
        if extra is None:
            raise
        sys.exit(
            f"nemo-is needs {exc.name}, which is not installed: install nemo-is-plugin[{extra}] "
            f"(pip install 'nemo-is-plugin[{extra}]')"
        )
