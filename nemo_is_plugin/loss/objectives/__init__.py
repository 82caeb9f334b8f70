"""The policy objectives, one module each (formula, keys, refusals, metrics), and their registry.

Importing this package imports every module in it (sorted by name; ``base`` and private modules excepted), so that a
new objective is its module alone: its ``@register_objective`` runs here. ``ClippedPGLossConfig`` imports the package
to build its keys (every registered :class:`~nemo_is_plugin.config.keys.KeySection`) and its ``policy_objective``
choices (``ppo_clip`` first, then the others by name). Formulas and sources: docs/objectives.md.
"""

from __future__ import annotations

import importlib
import pkgutil

from nemo_is_plugin.loss.objectives.base import (
    DEFAULT_OBJECTIVE,
    OBJECTIVES,
    ObjectiveInputs,
    ObjectiveOut,
    PolicyObjective,
    SurrogateOut,
    key_sections,
    objective_contradictions,
    objective_of,
    register_objective,
)

for _module in sorted(info.name for info in pkgutil.iter_modules(__path__)):
    if _module != "base" and not _module.startswith("_"):
        importlib.import_module(f"{__name__}.{_module}")


def objective_names() -> tuple[str, ...]:
    """The registered ``policy_objective`` values: the default first, then the others in module order."""
    return (DEFAULT_OBJECTIVE, *(name for name in OBJECTIVES if name != DEFAULT_OBJECTIVE))


__all__ = [
    "DEFAULT_OBJECTIVE",
    "OBJECTIVES",
    "ObjectiveInputs",
    "ObjectiveOut",
    "PolicyObjective",
    "SurrogateOut",
    "key_sections",
    "objective_contradictions",
    "objective_names",
    "objective_of",
    "register_objective",
]
