"""Loss registry: a host resolves a loss by the name its config gives (``loss_fn: {name: nemo_is.clipped_pg, ...}``).

Two sources, looked up in this order:

1. in-process registrations (``register_loss``), for losses defined in a user's own code or tests;
2. the ``nemo_is_plugin.losses`` entry-point group, declared in ``pyproject.toml`` by this package and by any other
   installed package, e.g. ``"nemo_is.clipped_pg" = "nemo_is_plugin.loss:ClippedPGLoss"``. Entry points are loaded
   lazily, on first lookup, so discovering names never imports torch or a loss module.

A registered object is a *loss factory*: called with one loss config mapping (the host's ``loss_fn`` section minus
``name``) it returns the loss. A class with a ``from_config`` classmethod is built through it; any other callable is
called with the mapping. An unknown name raises :class:`UnknownLossError`, whose message lists every registered name.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping
from importlib import import_module
from importlib.metadata import EntryPoint, entry_points
from typing import Any, TypeVar, overload

from nemo_is_plugin.config import ConfigError

ENTRY_POINT_GROUP = "nemo_is_plugin.losses"
DEFAULT_LOSS_NAME = "nemo_is.clipped_pg"
NAME_KEY = "name"  # the key of a loss_fn section that names the loss; stripped before the config is validated

LossFactory = Callable[..., Any]
Target = LossFactory | str  # an object, or a lazy "module:attr" reference
_T = TypeVar("_T", bound=Target)

_LOCAL: dict[str, Target] = {}


class UnknownLossError(ConfigError, LookupError):
    """A loss name that neither an in-process registration nor an installed entry point provides.

    A config error like any other (``loss_fn.name`` is a config key), and a ``LookupError`` (a failed name lookup).
    """

    def __init__(self, name: str, known: list[str]):
        self.name, self.known = name, known
        near = difflib.get_close_matches(name, known, n=1, cutoff=0.5)
        hint = f" Did you mean {near[0]!r}?" if near else ""
        listed = ", ".join(repr(k) for k in known) or "(none)"
        super().__init__(
            f"unknown loss {name!r}.{hint} Registered losses: {listed}. Register one with "
            f"nemo_is_plugin.registry.register_loss or an entry point in the {ENTRY_POINT_GROUP!r} group."
        )


def _entry_points() -> dict[str, EntryPoint]:
    # Re-read on every call: a package installed (or an editable install refreshed) after import is then visible.
    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


@overload
def register_loss(name: str, target: None = None, *, override: bool = False) -> Callable[[_T], _T]: ...
@overload
def register_loss(name: str, target: _T, *, override: bool = False) -> _T: ...
def register_loss(name: str, target: Target | None = None, *, override: bool = False) -> Any:
    """Register ``target`` (a loss factory or a ``"module:attr"`` string) under ``name``, in this process only.

    Usable directly, ``register_loss("my.loss", MyLoss)``, or as a decorator, ``@register_loss("my.loss")``.
    Re-registering a name with a different target raises unless ``override=True``; re-registering the same target is
    a no-op (module reloads stay harmless).
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"loss name must be a non-empty string, got {name!r}")

    def _do(obj: _T) -> _T:
        if not (callable(obj) or (isinstance(obj, str) and ":" in obj)):
            raise TypeError(f"register_loss({name!r}): expected a callable or a 'module:attr' string, got {obj!r}")
        old = _LOCAL.get(name)
        if old is not None and old is not obj and old != obj and not override:
            raise ValueError(f"loss {name!r} is already registered as {old!r}; pass override=True to replace it")
        _LOCAL[name] = obj
        return obj

    return _do if target is None else _do(target)


def unregister_loss(name: str) -> None:
    """Remove an in-process registration (entry points are untouched). Unknown names are ignored."""
    _LOCAL.pop(name, None)


def registered_names() -> list[str]:
    """Every resolvable loss name, sorted: in-process registrations and installed entry points."""
    return sorted(set(_LOCAL) | set(_entry_points()))


def _load_reference(ref: str) -> LossFactory:
    module, _, attr = ref.partition(":")
    obj: Any = import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def get_loss(name: str) -> LossFactory:
    """The loss factory registered under ``name``; raises :class:`UnknownLossError` listing the known names."""
    if name in _LOCAL:
        target = _LOCAL[name]
        return _load_reference(target) if isinstance(target, str) else target
    eps = _entry_points()
    if name in eps:
        try:
            return eps[name].load()
        except Exception as exc:  # an installed but broken plugin: say which entry point failed
            raise ImportError(
                f"loss {name!r}: entry point {eps[name].value!r} in group {ENTRY_POINT_GROUP!r} failed to load: {exc}"
            ) from exc
    raise UnknownLossError(name, registered_names())


def check_loss_name(name: str) -> None:
    """Raise :class:`UnknownLossError` unless ``name`` is registered (nothing is imported)."""
    known = registered_names()
    if name not in known:
        raise UnknownLossError(name, known)


def split_name(section: Mapping[str, Any] | None, default: str = DEFAULT_LOSS_NAME) -> tuple[str, dict[str, Any]]:
    """``(name, config)`` from a host's ``loss_fn`` section: ``name`` is popped (``default`` when absent)."""
    config = dict(section or {})
    name = config.pop(NAME_KEY, None) or default
    if not isinstance(name, str):
        raise TypeError(f"loss_fn.{NAME_KEY} must be a string, got {name!r}")
    return name, config


def build_loss(section: Mapping[str, Any] | None = None, *, name: str | None = None, **kwargs: Any) -> Any:
    """Build the loss a ``loss_fn`` section names (``name`` argument > ``section['name']`` > the default).

    ``kwargs`` go to the factory unchanged (e.g. process groups). The section must already be a plain mapping;
    :mod:`nemo_is_plugin.recipes` turns YAML files and OmegaConf configs into one.
    """
    section_name, config = split_name(section)
    factory = get_loss(name or section_name)
    from_config = getattr(factory, "from_config", None)
    if callable(from_config):
        return from_config(config, **kwargs)
    return factory(config, **kwargs)
