"""The ``nemo-is`` command line: one module per command, each exposing ``register(app)``; ``main`` is the typer app.

Needs the ``cli`` extra (``pip install 'nemo-is-plugin[cli]'``); the console script is :func:`nemo_is_plugin.apps.run`,
which names the extra when it is missing.
"""

from nemo_is_plugin.common.extras import require_extra

require_extra("cli", __name__)
