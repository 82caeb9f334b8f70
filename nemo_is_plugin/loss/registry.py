"""Loss registry: a host resolves a loss by the name its config gives (``loss_fn: {name: nemo_is.clipped_pg, ...}``).

A name is looked up in :data:`LOSSES` (in-process registrations: a user's own losses, tests), then in the
``nemo_is_plugin.losses`` entry-point group, which any installed package declares in its ``pyproject.toml``, e.g.
``"my.loss" = "my_package.losses:MyLoss"``, then among this package's own losses (:data:`BUILTIN_LOSSES`). The
package's own are not read from its installed metadata: a worker that imports the plugin from ``PYTHONPATH`` (the
documented way into NeMo-RL's and verl's Ray workers, and the GPU check's) has none, and must still find them.
Entry points are loaded on lookup, so listing names imports no loss module. A registered object is a *loss factory*:
called with one loss config (the ``loss_fn`` section minus ``name``) and the builder's keyword arguments, it returns
the loss.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from importlib.metadata import EntryPoint, entry_points
from typing import Any

from nemo_is_plugin.config import ConfigError, closest_name
from nemo_is_plugin.loss.config_model import ClippedPGLossConfig

ENTRY_POINT_GROUP = "nemo_is_plugin.losses"
DEFAULT_LOSS_NAME = "nemo_is.clipped_pg"
NAME_KEY = "name"  # the key of a loss_fn section that names the loss; stripped before the config is validated

LossFactory = Callable[..., Any]
LOSSES: dict[str, LossFactory] = {}  # name -> factory, registered in this process; shadows an entry point's name
# this package's losses, "module:attribute" as an entry point's value (an installed entry point of the same name wins)
BUILTIN_LOSSES: dict[str, str] = {DEFAULT_LOSS_NAME: "nemo_is_plugin.loss:ClippedPGLoss"}


class UnknownLossError(ConfigError, LookupError):
    """A loss name that neither :data:`LOSSES` nor an installed entry point provides.

    A config error like any other (``loss_fn.name`` is a config key), and a ``LookupError`` (a failed name lookup).
    """

    def __init__(self, name: str, known: list[str]):
        self.name, self.known = name, known
        near = closest_name(name, known)
        hint = f" Did you mean {near!r}?" if near else ""
        listed = ", ".join(repr(k) for k in known) or "(none)"
        super().__init__(
            f"unknown loss {name!r}.{hint} Registered losses: {listed}. Register one in "
            f"nemo_is_plugin.registry.LOSSES or as an entry point in the {ENTRY_POINT_GROUP!r} group."
        )


class LossEntryPointError(ConfigError, ImportError):
    """The entry point of the loss a config names failed to load: a config error (the CLI's exit 2) and an
    ``ImportError``. Raised only for the loss named: the other names resolve whatever else is installed."""


_INSTALLED: dict[str, EntryPoint] | None = None  # the group's installed entry points, as last read


def _entry_points(reread: bool = False) -> dict[str, EntryPoint]:
    """The package's own losses and every installed entry point of the group (which may override them by name).

    The installed ones are read once and kept: reading them scans every distribution on ``sys.path`` (~12 ms here,
    and a loss is looked up at every construction). ``reread``: read them again, as a lookup that misses does, so that
    a package installed (or an editable install refreshed) after the first read is still found by its name."""
    global _INSTALLED
    if reread or _INSTALLED is None:
        _INSTALLED = {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}
    builtin = {name: EntryPoint(name, value, ENTRY_POINT_GROUP) for name, value in BUILTIN_LOSSES.items()}
    return builtin | _INSTALLED


def registered_names() -> list[str]:
    """Every resolvable loss name, sorted: in-process registrations and installed entry points (read anew)."""
    return sorted(set(LOSSES) | set(_entry_points(reread=True)))


def check_loss_name(name: str) -> None:
    """Raise :class:`UnknownLossError` unless ``name`` is registered (nothing is imported)."""
    known = registered_names()
    if name not in known:
        raise UnknownLossError(name, known)


def get_loss(name: str) -> LossFactory:
    """The loss factory registered under ``name``; raises :class:`UnknownLossError` listing the known names."""
    if name in LOSSES:
        return LOSSES[name]
    eps = _entry_points()
    if name not in eps:
        eps = _entry_points(reread=True)  # installed since the last read?
    if name not in eps:
        raise UnknownLossError(name, registered_names())
    try:
        return eps[name].load()
    except Exception as exc:  # an installed but broken plugin: say which entry point failed, only when it is named
        raise LossEntryPointError(
            f"loss {name!r}: entry point {eps[name].value!r} in group {ENTRY_POINT_GROUP!r} failed to load "
            f"({type(exc).__name__}: {' '.join(str(exc).split())}): repair or reinstall the package that declares it, "
            "or name another loss"
        ) from exc


def split_name(section: Mapping[str, Any] | None, default: str = DEFAULT_LOSS_NAME) -> tuple[str, dict[str, Any]]:
    """``(name, config)`` from a host's ``loss_fn`` section: ``name`` is popped (``default`` when absent)."""
    config = dict(section or {})
    name = config.pop(NAME_KEY, None) or default
    if not isinstance(name, str):
        raise TypeError(f"loss_fn.{NAME_KEY} must be a string, got {name!r}")
    return name, config


def build_loss_fn(config: Mapping[str, Any] | ClippedPGLossConfig | None = None, **kwargs: Any) -> Any:
    """The loss a NeMo-RL ``loss_fn`` section names, built with its keys: the package's one way to build a loss.

    ``config``: a mapping or OmegaConf node (``name`` selects a registered loss, default ``nemo_is.clipped_pg``;
    YAML files and overrides: :mod:`nemo_is_plugin.recipes`), or a validated ``ClippedPGLossConfig`` (the default
    loss). ``kwargs`` go to the factory unchanged (e.g. process groups). The default loss is called exactly like
    NeMo-RL's ``ClippedPGLossFn``.
    """
    if isinstance(config, ClippedPGLossConfig):
        return get_loss(DEFAULT_LOSS_NAME)(config, **kwargs)
    name, rest = split_name(config)
    return get_loss(name)(rest, **kwargs)
