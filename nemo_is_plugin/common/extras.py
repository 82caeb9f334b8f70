"""The optional extras (pyproject.toml) and the one-line error that names the extra to install when one is missing.

``pip install nemo-is-plugin`` brings the loss, the kernels and the host adapters; the command line and its apps
(``cli``), megatron-core (``megatron``: the Megatron entry points' ``groups="parallel_state"``, slime) and the demo
(``demo``) are extras. A module that needs one checks it before anything fails deeper with a bare
``ModuleNotFoundError``, without importing the extra's packages (:func:`require_extra`).
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterable

# The top-level modules each extra brings (pyproject.toml's optional dependencies; ``demo`` includes ``cli`` and
# ``megatron``).
EXTRA_MODULES: dict[str, tuple[str, ...]] = {
    "cli": ("typer", "rich", "matplotlib", "pyarrow"),
    "megatron": ("megatron",),
    "demo": ("typer", "rich", "matplotlib", "pyarrow", "megatron", "ray"),
}
# The smallest extra that brings each module (click comes with typer).
EXTRA_OF_MODULE = {"click": "cli", **{m: "cli" for m in EXTRA_MODULES["cli"]}, "megatron": "megatron", "ray": "demo"}


def install_hint(extra: str) -> str:
    return f"pip install 'nemo-is-plugin[{extra}]'"


class MissingExtraError(ModuleNotFoundError):
    """A module of an optional extra is not installed; the message names the extra to install, in one line.

    A ``ModuleNotFoundError`` (so an ``ImportError``) whose ``name`` is the first missing module and ``extra`` the
    extra that brings it.
    """

    def __init__(self, message: str, *, name: str, extra: str):
        super().__init__(message, name=name)
        self.extra = extra


def missing_modules(modules: Iterable[str]) -> list[str]:
    """The top-level modules of ``modules`` that cannot be imported, found without importing any of them (a module
    set to None in ``sys.modules`` counts as missing, as ``import`` treats it)."""
    missing = []
    for module in modules:
        if module in sys.modules:
            if sys.modules[module] is None:
                missing.append(module)
        elif importlib.util.find_spec(module) is None:
            missing.append(module)
    return missing


def require_extra(extra: str, who: str) -> None:
    """Raise :class:`MissingExtraError` naming ``extra`` when a module it brings is missing; ``who`` says what needs
    it (a module name or a feature)."""
    missing = missing_modules(EXTRA_MODULES[extra])
    if missing:
        raise MissingExtraError(
            f"{who} needs the '{extra}' extra ({', '.join(missing)} not installed): {install_hint(extra)}",
            name=missing[0],
            extra=extra,
        )


def missing_extra(exc: BaseException) -> str | None:
    """The extra whose absence raised ``exc``; None when ``exc`` is not a missing module that an extra brings."""
    if isinstance(exc, MissingExtraError):
        return exc.extra
    if not isinstance(exc, ModuleNotFoundError) or not exc.name:
        return None
    return EXTRA_OF_MODULE.get(exc.name.split(".")[0])


__all__ = [
    "EXTRA_MODULES",
    "EXTRA_OF_MODULE",
    "MissingExtraError",
    "install_hint",
    "missing_extra",
    "missing_modules",
    "require_extra",
]
