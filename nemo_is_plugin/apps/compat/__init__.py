"""``nemo-is compat``: does swapping the host's loss for the plugin's change anything, for *this* config on *this*
installed host? Builds both losses from the user's own trainer config, runs them on the same batches and compares
loss, gradient and every metric the host reports (docs/compat.md).

- :mod:`~nemo_is_plugin.apps.compat.batches`: the synthetic batches (and those of a rollout dump);
- :mod:`~nemo_is_plugin.apps.compat.nemo_rl_host`, :mod:`~nemo_is_plugin.apps.compat.verl_host`: each host, imported as
  installed;
- :mod:`~nemo_is_plugin.apps.compat.compare`: the comparison, its tolerances and the report;
- :mod:`~nemo_is_plugin.apps.compat.render`: the report as a table and as JSON.
"""

from __future__ import annotations

from pathlib import Path

from nemo_is_plugin.common.extras import require_extra

require_extra("cli", __name__)  # the app imports only with its extra

HOSTS = ("nemo-rl", "verl")


def load_host(host: str, config: str | Path, overrides: list[str] | tuple[str, ...] = ()):
    """The :class:`~nemo_is_plugin.apps.compat.compare.Host` for ``host`` built from ``config``; raises
    ``HostUnavailableError`` when the host does not import and a ``ConfigError`` for a config it cannot read."""
    if host == "nemo-rl":
        from nemo_is_plugin.apps.compat.nemo_rl_host import NeMoRLHost

        return NeMoRLHost(config, overrides)
    if host == "verl":
        from nemo_is_plugin.apps.compat.verl_host import VerlHost

        return VerlHost(config, overrides)
    raise ValueError(f"--host {host!r}: one of {', '.join(HOSTS)}")
