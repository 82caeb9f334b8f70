"""An objective selected by import path, for experiments: ``policy_objective: my_pkg.module:MyObjective``.

The module is imported when a config names it (in a Ray worker too: the config travels as keys). A class the
registry already holds (its module registered it, through the entry-point group or an import before the config was
built) resolves to its registered name. Any other :class:`PolicyObjective` subclass is registered under the path itself
if it declares no keys of its own: the config's keys are fixed when it is first built, so an objective with a
:class:`~nemo_is_plugin.config.keys.KeySection` joins through the entry-point group (docs/writing_an_objective.md).
Every failure is one line naming the path, what failed and the fix.
"""

from __future__ import annotations

import importlib
import re

from nemo_is_plugin.config.errors import ConfigError
from nemo_is_plugin.loss.objectives.base import OBJECTIVES, PolicyObjective

# module path ':' attribute path, e.g. my_pkg.objectives:Tapered or my_pkg.mod:Outer.Inner
IMPORT_PATH = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*")
# the import paths registered under their own name (outside the config's policy_objective choices)
REGISTERED_BY_PATH: set[str] = set()


def is_import_path(value: str) -> bool:
    return IMPORT_PATH.fullmatch(value) is not None


def objective_by_import_path(path: str) -> str:
    """The registry name of the objective class at ``path`` (``module:Class``), importing its module; raises a
    one-line :class:`ConfigError` when the import fails or the attribute is not a usable objective class."""
    module_name, _, attribute = path.partition(":")
    where = f"policy_objective={path!r}"
    try:
        found: object = importlib.import_module(module_name)
    except Exception as exc:  # whatever the user's module raises at import
        raise ConfigError(
            f"{where}: importing {module_name!r} failed ({type(exc).__name__}: {' '.join(str(exc).split())}); "
            "the value is 'module:Class' of a PolicyObjective subclass importable by this process (check the path, "
            "and PYTHONPATH or the package's installation in every worker)"
        ) from None
    for part in attribute.split("."):
        if not hasattr(found, part):
            raise ConfigError(f"{where}: {module_name!r} has no attribute {attribute!r}")
        found = getattr(found, part)
    if not (isinstance(found, type) and issubclass(found, PolicyObjective)) or found is PolicyObjective:
        raise ConfigError(f"{where} is {found!r}, not a subclass of nemo_is_plugin.objectives.PolicyObjective")
    registered = OBJECTIVES.get(found.name)
    if registered is not None and type(registered) is found:
        return found.name
    if found.keys is not None:
        raise ConfigError(
            f"{where} declares keys of its own ({found.keys.__name__}), which the config, built once at its first "
            "use, cannot add: name its module in the entry-point group 'nemo_is_plugin.objectives' "
            "(docs/writing_an_objective.md), or import it before the first config is built"
        )
    if path not in OBJECTIVES:
        OBJECTIVES[path] = found()
        REGISTERED_BY_PATH.add(path)
    return path


__all__ = ["IMPORT_PATH", "REGISTERED_BY_PATH", "is_import_path", "objective_by_import_path"]
