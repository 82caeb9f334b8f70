"""The policy objectives, one module each (formula, keys, refusals, metrics), and their registry.

Importing this package imports every module in it (sorted by name; ``base`` and private modules excepted), so that a
new objective is its module alone: its ``@register_objective`` runs here. An objective of another package registers
the same way in a module it names in the entry-point group ``nemo_is_plugin.objectives``
(:func:`load_entry_point_objectives`; one that fails to load is a warning, and an error only for a config naming an
objective nothing registers: ``_entry_points``). ``ClippedPGLossConfig`` loads those, then builds its keys (every
registered :class:`~nemo_is_plugin.config.keys.KeySection`) and its ``policy_objective`` choices (``ppo_clip`` first,
then the others in registration order) from the registry, once, when it is first used; a registration after that is
refused.
Formulas and sources: docs/objectives.md.
"""

from __future__ import annotations

import importlib
import pkgutil

from nemo_is_plugin.loss.objectives._entry_points import (
    ENTRY_POINT_FAILURES,
    ENTRY_POINT_GROUP,
    EntryPointFailure,
    load_entry_point_objectives,
    unresolved_objective_message,
)
from nemo_is_plugin.loss.objectives._import_path import REGISTERED_BY_PATH
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


# This package's own objectives, before any entry point adds its own: what the project's tests enumerate, so that they
# hold whatever else is installed.
BUILTIN_OBJECTIVES: tuple[str, ...] = tuple(OBJECTIVES)


def objective_names() -> tuple[str, ...]:
    """The registered ``policy_objective`` values: the default first, then the others in registration order (this
    package's modules by name, then the entry points'); not the import paths a config named (``_import_path``)."""
    others = (name for name in OBJECTIVES if name != DEFAULT_OBJECTIVE and name not in REGISTERED_BY_PATH)
    return (DEFAULT_OBJECTIVE, *others)


__all__ = [
    "BUILTIN_OBJECTIVES",
    "DEFAULT_OBJECTIVE",
    "ENTRY_POINT_FAILURES",
    "ENTRY_POINT_GROUP",
    "EntryPointFailure",
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
    "unresolved_objective_message",
]
