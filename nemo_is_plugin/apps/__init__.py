"""The apps: what the ``nemo-is`` command line runs, beside the runtime a trainer imports (the loss, the kernels, the
distributed entry points, the host adapters), which never imports them (tests/test_layers.py).

- ``cli``: the typer app ``nemo-is`` (``cli/main.py``), one module per command;
- ``compat``: the installed host's loss against the plugin's, on the user's own config (``nemo-is compat``);
- ``demo``: GRPO on a tiny megatron-core MoE with a Ray rollout worker (``nemo-is demo``);
- ``diagnose``: the mismatch diagnostics of a rollout dump (``nemo-is diagnose``);
- ``evidence``: published claims about IS corrections and KL estimators, recomputed (``nemo-is evidence``);
- ``bench``: the LM head -> log-prob -> loss benchmark (``nemo-is bench``).

Each app imports only with its extra (``cli``; the demo: ``demo``): importing one without it raises a
:class:`~nemo_is_plugin.common.extras.MissingExtraError` (an ``ImportError``) naming the extra to install. This
package itself needs none: :func:`run` is the console script, and answers a missing extra with one line.
"""

from __future__ import annotations

import sys

from nemo_is_plugin.common.extras import install_hint, missing_extra


def run() -> None:
    """Run ``nemo-is``; exit with status 1 and a one-line message when a package of an extra is not installed."""
    try:
        from nemo_is_plugin.apps.cli.main import app

        app()
    except ModuleNotFoundError as exc:
        extra = missing_extra(exc)
        if extra is None:
            raise
        sys.exit(
            f"nemo-is needs {exc.name}, which is not installed: install nemo-is-plugin[{extra}] ({install_hint(extra)})"
        )


__all__ = ["run"]
