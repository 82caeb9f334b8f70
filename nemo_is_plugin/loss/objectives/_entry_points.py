"""Other packages' objectives, found through the entry-point group ``nemo_is_plugin.objectives``, and what is said
when one cannot be had.

Each entry point names a module (or an attribute of one) whose ``@register_objective`` runs when it is loaded. A
package whose entry point fails to load (a missing module, an error at import, a name registered twice) must not break
the configs that do not use it: its failure is recorded and warned about once, whatever it had registered is taken
back, and only a config naming an objective that cannot be resolved is refused, in one line that names the failed
entry points, why they failed and the fix (:func:`unresolved_objective_message`).
"""

from __future__ import annotations

import importlib.metadata
import warnings
from dataclasses import dataclass

from nemo_is_plugin.config.errors import ObjectiveEntryPointWarning
from nemo_is_plugin.config.unknown_keys import closest_name
from nemo_is_plugin.loss.objectives.base import OBJECTIVES

ENTRY_POINT_GROUP = "nemo_is_plugin.objectives"


@dataclass(frozen=True)
class EntryPointFailure:
    """One entry point that did not load: ``entry`` as declared (``name = module:attr``), the distribution that
    declares it (None when unknown) and the error, as ``Type: message``."""

    entry: str
    distribution: str | None
    error: str

    def describe(self) -> str:
        owner = f" of package {self.distribution!r}" if self.distribution else ""
        return f"{self.entry!r}{owner} failed to load ({self.error})"

    def fix(self) -> str:
        package = self.distribution or "the package that declares it"
        return f"repair or reinstall {package}, or uninstall it (pip uninstall {package})"


ENTRY_POINT_FAILURES: list[EntryPointFailure] = []
_LOADED_GROUPS: set[str] = set()


def _distribution(entry: importlib.metadata.EntryPoint) -> str | None:
    dist = getattr(entry, "dist", None)
    return None if dist is None else f"{dist.metadata['Name']}"


def load_entry_point_objectives(group: str = ENTRY_POINT_GROUP) -> tuple[str, ...]:
    """Load every entry point of ``group`` (sorted by entry-point name), whose ``@register_objective`` then runs;
    once per process. Returns the objective names they added. An entry point that fails is recorded in
    :data:`ENTRY_POINT_FAILURES` and warned about (:class:`ObjectiveEntryPointWarning`), and the objectives it had
    registered before failing are removed: the other objectives and every config that does not name its objectives
    are unaffected."""
    if group in _LOADED_GROUPS:
        return ()
    _LOADED_GROUPS.add(group)
    before = set(OBJECTIVES)
    for entry in sorted(importlib.metadata.entry_points(group=group), key=lambda e: e.name):
        registered = set(OBJECTIVES)
        try:
            entry.load()
        except Exception as exc:  # any error of a third party's import: recorded, never raised here
            for name in set(OBJECTIVES) - registered:
                del OBJECTIVES[name]
            failure = EntryPointFailure(f"{entry.name} = {entry.value}", _distribution(entry), _one_line(exc))
            ENTRY_POINT_FAILURES.append(failure)
            warnings.warn(
                f"policy objective entry point {failure.describe()} in group {group!r}: its objectives are unavailable "
                f"(configs that do not name them are unaffected); {failure.fix()}",
                ObjectiveEntryPointWarning,
                stacklevel=2,
            )
    return tuple(name for name in OBJECTIVES if name not in before)


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def unresolved_objective_message(name: str, known: tuple[str, ...]) -> str:
    """One line for a ``policy_objective`` nothing registers: the nearest registered name, the registered names, and
    the entry points that failed to load (why, and the fix) when there are any."""
    near = closest_name(name, known)
    hint = f" (did you mean {near!r}?)" if near else ""
    message = f"policy_objective={name!r} is not a registered objective{hint}; registered: {', '.join(known)}"
    if ENTRY_POINT_FAILURES:
        failed = "; ".join(f"{f.describe()}: {f.fix()}" for f in ENTRY_POINT_FAILURES)
        return f"{message}; these entry points of group {ENTRY_POINT_GROUP!r} may provide it but failed: {failed}"
    return (
        f"{message}. An objective of another package is registered through its entry point in the group "
        f"{ENTRY_POINT_GROUP!r}, or named by import path, 'module:Class' (docs/writing_an_objective.md)"
    )


__all__ = [
    "ENTRY_POINT_FAILURES",
    "ENTRY_POINT_GROUP",
    "EntryPointFailure",
    "load_entry_point_objectives",
    "unresolved_objective_message",
]
