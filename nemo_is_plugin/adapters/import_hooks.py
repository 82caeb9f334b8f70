"""Run a function right after a module is imported, or now if it already is: how the host heads patch a host.

A host binds the function the plugin replaces when its module executes (NeMo-RL's ``nemo_rl.distributed.model_utils``,
verl's ``verl.models.mcore.model_forward_fused``), in its own worker processes, at a moment the plugin does not
control. :func:`when_imported` registers a callback keyed by the module's name; a finder at the front of
``sys.meta_path`` wraps that module's loader so that the callback runs as soon as the module's code has executed,
before the importing statement returns, hence before any caller can use the module. A callback that raises makes the
import itself raise (importlib then removes the half-patched module): a patch that cannot be applied stops the
process instead of letting the host's own code run silently.

Standard library only, and no import of the package: the plugin's startup hook
(``nemo_is_plugin/adapters/nemo_rl/startup/sitecustomize.py``) loads this file by path at interpreter start, before
torch or the plugin could be imported. The registry lives on the ``sys`` module, so a copy loaded that way and
``nemo_is_plugin.adapters.import_hooks`` share it.
"""

from __future__ import annotations

import importlib.abc
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

_REGISTRY = "_nemo_is_after_import_callbacks"  # attribute of ``sys``: {module name: {key: callback}}
Callback = Callable[[ModuleType], None]


class HostPatchError(RuntimeError):
    """The host's function the plugin replaces is missing or changed: the plugin's head cannot stand in for it (what
    a patch raises, failing the host's import; both hosts' heads raise it)."""


def _registry() -> dict[str, dict[str, Callback]]:
    registry = getattr(sys, _REGISTRY, None)
    if registry is None:
        registry = {}
        setattr(sys, _REGISTRY, registry)
    return registry


class _PatchingLoader(importlib.abc.Loader):
    """The module's own loader, then the callbacks registered for it."""

    def __init__(self, loader: Any, name: str) -> None:
        self._loader, self._name = loader, name

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        for callback in list(_registry().get(self._name, {}).values()):
            callback(module)

    def __getattr__(self, attr: str) -> Any:  # get_source, get_filename, is_package, ... of the real loader
        return getattr(self._loader, attr)


class AfterImportFinder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for a module with callbacks it asks the finders behind it and wraps the loader found."""

    nemo_is_after_import = True  # marks the one instance on sys.meta_path, whichever copy of this file made it

    def __init__(self) -> None:
        self._busy: set[str] = set()

    def find_spec(self, fullname: str, path=None, target=None):
        if fullname not in _registry() or fullname in self._busy:
            return None
        self._busy.add(fullname)
        try:
            for finder in sys.meta_path:
                if getattr(finder, "nemo_is_after_import", False) or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
            else:
                return None
        finally:
            self._busy.discard(fullname)
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _PatchingLoader(spec.loader, fullname)
        return spec


def install_finder() -> None:
    """Put the finder at the front of ``sys.meta_path`` (once per process)."""
    if not any(getattr(f, "nemo_is_after_import", False) for f in sys.meta_path):
        sys.meta_path.insert(0, AfterImportFinder())


def when_imported(module: str, key: str, callback: Callback) -> None:
    """Call ``callback(mod)`` right after ``module`` is imported, or now if it already is. ``key`` names the
    callback: registering the same key again replaces it (a second registration never runs a patch twice)."""
    _registry().setdefault(module, {})[key] = callback
    install_finder()
    loaded = sys.modules.get(module)
    if loaded is not None and not _initialising(loaded):
        callback(loaded)


def _initialising(module: ModuleType) -> bool:
    spec = getattr(module, "__spec__", None)
    return bool(getattr(spec, "_initializing", False))


def registered(module: str) -> list[str]:
    """The keys of the callbacks registered for ``module``."""
    return sorted(_registry().get(module, {}))


__all__ = ["AfterImportFinder", "HostPatchError", "install_finder", "registered", "when_imported"]
