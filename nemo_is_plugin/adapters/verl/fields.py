"""What the verl adapter's modules share: the errors of a verl setting and how a field of verl's config is read.

Kept apart so that the config mapping (:mod:`.config`) and the loss-mode table (:mod:`.loss_modes`), which use
each other's vocabulary, both import from here instead of from each other.
"""

from __future__ import annotations

from typing import Any

from nemo_is_plugin.config import ConfigError, ConfigTypeError


class VerlConfigError(ConfigError):
    """A verl setting the plugin cannot honour; the message names the key and the fix."""


class VerlConfigTypeError(VerlConfigError, ConfigTypeError):
    """A verl setting of the wrong type (e.g. ``rollout_is_threshold: true``): also a ``TypeError``, as in verl."""


def verl_field(config: Any, key: str, default: Any = None) -> Any:
    """A field of verl's ActorConfig (dataclass with .get), an OmegaConf node or a dict; ``default`` when absent."""
    if config is None:
        return default
    getter = getattr(config, "get", None)
    value = getter(key, default) if callable(getter) else getattr(config, key, default)
    return default if value is None else value


__all__ = ["VerlConfigError", "VerlConfigTypeError", "verl_field"]
