"""The policy objectives, one module each (formula, keys, refusals, metrics), and their registry.

Importing this package imports every module in it (sorted by name; ``base`` and private modules excepted), so that a
new objective is its module alone: its ``@register_objective`` runs here. An objective of another package registers
the same way in a module it names in the entry-point group ``nemo_is_plugin.objectives``
(:func:`load_entry_point_objectives`). ``ClippedPGLossConfig`` loads those, then builds its keys (every registered
:class:`~nemo_is_plugin.config.keys.KeySection`) and its ``policy_objective`` choices (``ppo_clip`` first, then the
others in registration order) from the registry, once, when it is first used; a registration after that is refused.
Formulas and sources: docs/objectives.md.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import pkgutil

from nemo_is_plugin.loss.objectives.base import (
    DEFAULT_OBJECTIVE,
    OBJECTIVES,
    ObjectiveInputs,
    ObjectiveOut,
    PolicyObjective,
    SurrogateOut,
    effective_objective,
    key_sections,
    objective_contradictions,
    objective_of,
    register_objective,
    seal_registry,
)
from nemo_is_plugin.loss.objectives.config_view import ObjectiveConfig
from nemo_is_plugin.loss.objectives.nemo_rl_switches import (
    effective_objective_of_keys,
    selecting_switch,
    unread_clip_keys,
)

for _module in sorted(info.name for info in pkgutil.iter_modules(__path__)):
    if _module != "base" and not _module.startswith("_"):
        importlib.import_module(f"{__name__}.{_module}")


ENTRY_POINT_GROUP = "nemo_is_plugin.objectives"
_LOADED_GROUPS: set[str] = set()


def load_entry_point_objectives(group: str = ENTRY_POINT_GROUP) -> tuple[str, ...]:
    """Import the module of every entry point of ``group`` (sorted by entry-point name), whose ``@register_objective``
    then runs; once per process. Returns the objective names they added. A module that fails to import is reported
    with its entry point, and the config is not built without it."""
    if group in _LOADED_GROUPS:
        return ()
    before = set(OBJECTIVES)
    for entry in sorted(importlib.metadata.entry_points(group=group), key=lambda e: e.name):
        try:
            entry.load()
        except Exception as exc:
            raise ImportError(f"policy objective entry point {entry.name} = {entry.value} ({group}): {exc}") from exc
    _LOADED_GROUPS.add(group)
    return tuple(name for name in OBJECTIVES if name not in before)


def objective_names() -> tuple[str, ...]:
    """The registered ``policy_objective`` values: the default first, then the others in registration order (this
    package's modules by name, then the entry points')."""
    return (DEFAULT_OBJECTIVE, *(name for name in OBJECTIVES if name != DEFAULT_OBJECTIVE))


__all__ = [
    "DEFAULT_OBJECTIVE",
    "ENTRY_POINT_GROUP",
    "OBJECTIVES",
    "ObjectiveConfig",
    "ObjectiveInputs",
    "ObjectiveOut",
    "PolicyObjective",
    "SurrogateOut",
    "effective_objective",
    "key_sections",
    "load_entry_point_objectives",
    "objective_contradictions",
    "objective_names",
    "effective_objective_of_keys",
    "objective_of",
    "register_objective",
    "seal_registry",
    "selecting_switch",
    "unread_clip_keys",
]
