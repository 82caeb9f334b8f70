"""The authors' API: what a policy objective of another package (or an experiment) imports. The guide is
docs/writing_an_objective.md; examples/tapered_reinforce/ is a complete package built on these names alone.

- :class:`PolicyObjective` (subclass it: ``name``, ``keys``, ``summary``, :meth:`~PolicyObjective.surrogate`, and
  the optional hooks), :class:`TokenRatioObjective` (an objective on the token ratio alone);
- :func:`register_objective` (its class decorator) and :data:`ENTRY_POINT_GROUP`, the entry-point group that names
  the module to import before the config is built;
- :class:`KeySection` (its keys: flat ``loss_fn`` keys, validated with the plugin's) and :class:`NumericRange` (a key's
  valid interval, why, and the fix);
- :class:`ObjectiveInputs` (what the formula reads), :class:`SurrogateOut` (its per-token result, keyword-built; the
  ratio and clip indicators optional) and :class:`ObjectiveOut` (that, and the state its own metrics read);
- :class:`ObjectiveConfig` (the config a hook receives), :data:`OBJECTIVE_LOG_RATIO_CLAMP` (the clamp of
  :meth:`ObjectiveInputs.token_log_ratio`), :func:`objective_names` and :data:`BUILTIN_OBJECTIVES`.

An objective can also be selected by import path, ``policy_objective: my_pkg.module:MyObjective``, for experiments
(a class without keys of its own, or one its module registered). The sources are ``loss/objectives/`` and
``config/``; this module only re-exports them (no module of the package imports it).
"""

from nemo_is_plugin.config.field_types import NumericRange
from nemo_is_plugin.config.keys import KeySection
from nemo_is_plugin.loss.objectives import (
    BUILTIN_OBJECTIVES,
    ENTRY_POINT_GROUP,
    ObjectiveConfig,
    ObjectiveInputs,
    ObjectiveOut,
    PolicyObjective,
    SurrogateOut,
    objective_names,
    register_objective,
)
from nemo_is_plugin.loss.objectives.base import OBJECTIVE_LOG_RATIO_CLAMP, TokenRatioObjective

__all__ = [
    "BUILTIN_OBJECTIVES",
    "ENTRY_POINT_GROUP",
    "OBJECTIVE_LOG_RATIO_CLAMP",
    "KeySection",
    "NumericRange",
    "ObjectiveConfig",
    "ObjectiveInputs",
    "ObjectiveOut",
    "PolicyObjective",
    "SurrogateOut",
    "TokenRatioObjective",
    "objective_names",
    "register_objective",
]
