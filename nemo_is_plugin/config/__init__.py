"""The loss configuration's schema (pydantic v2; importing this package imports no torch): with the objectives' key
sections, the only place where defaults live.

Modules: ``keys`` (every generic key, one field each: type, default, choices, valid range with why and fix; and
:class:`~nemo_is_plugin.config.keys.KeySection`, what a policy objective's keys are declared as, in its module),
``field_types`` (what fields are built from: :class:`NumericRange`, a bool-refusing number, the KL estimator
vocabulary), ``rejection_rule`` (:class:`RejectionRule`, verl's ``rollout_rs`` options), ``contradictions`` (the
combination checks), ``unknown_keys`` (warn or refuse unknown keys), ``errors`` (the exception and warning types).

The assembled model, :class:`ClippedPGLossConfig` (the generic keys and every registered objective's section) with
:func:`load_loss_config`, ``NUMERIC_RANGES`` and ``PolicyObjective``, is built from the objective modules (torch) and
lives in the loss layer, above this package: import it from ``nemo_is_plugin.loss.config_model`` (or
``ClippedPGLossConfig`` from the top-level ``nemo_is_plugin``). This package imports nothing from the loss, not even
lazily (docs/design.md, *Layers*; tests/test_layers.py); importing one of those names from here raises an
``ImportError`` that says where it lives.
"""

from nemo_is_plugin.config.errors import (
    ConfigError,
    ConfigTypeError,
    ConfigValidationError,
    ConfigValidationTypeError,
    ObjectiveEntryPointWarning,
    UnknownConfigKeyWarning,
)
from nemo_is_plugin.config.field_types import KLType, NumericRange
from nemo_is_plugin.config.keys import (
    REJECTION_TYPES,
    SEQUENCE_MASK_TYPES,
    TOKEN_AGGREGATIONS,
    ISCorrectionLevel,
    KLGradient,
    LossAggregation,
    OldPolicyLogprobs,
    RatioLevel,
    RejectionType,
    TruncationType,
)
from nemo_is_plugin.config.rejection_rule import (
    REJECTION_LOG_RATIO_CLAMP,
    VERL_RS_AGGREGATIONS,
    VERL_RS_OPTIONS,
    RejectionAggregation,
    RejectionRule,
    RejectionStatistic,
    verl_rejection_rule,
)
from nemo_is_plugin.config.unknown_keys import (
    STRICT_KEYS_ENV,
    check_unknown_keys,
    closest_name,
    strict_keys_default,
    unknown_keys_message,
)

# The assembled model's names, which this package re-exported (lazily) until it stopped importing the loss: importing
# one from here says where it lives instead of Python's bare "cannot import name".
MOVED_TO_THE_LOSS = ("ClippedPGLossConfig", "load_loss_config", "NUMERIC_RANGES", "PolicyObjective")


def __getattr__(name: str) -> object:
    if name in MOVED_TO_THE_LOSS:
        raise ImportError(
            f"nemo_is_plugin.config.{name} is the assembled config of the loss layer: import it from "
            f"nemo_is_plugin.loss.config_model (ClippedPGLossConfig also from nemo_is_plugin)",
            name=name,
        )
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "REJECTION_LOG_RATIO_CLAMP",
    "REJECTION_TYPES",
    "SEQUENCE_MASK_TYPES",
    "STRICT_KEYS_ENV",
    "TOKEN_AGGREGATIONS",
    "VERL_RS_AGGREGATIONS",
    "VERL_RS_OPTIONS",
    "ConfigError",
    "ConfigTypeError",
    "ConfigValidationError",
    "ConfigValidationTypeError",
    "ISCorrectionLevel",
    "KLGradient",
    "KLType",
    "LossAggregation",
    "NumericRange",
    "OldPolicyLogprobs",
    "RatioLevel",
    "RejectionAggregation",
    "RejectionRule",
    "RejectionStatistic",
    "ObjectiveEntryPointWarning",
    "RejectionType",
    "TruncationType",
    "UnknownConfigKeyWarning",
    "check_unknown_keys",
    "closest_name",
    "strict_keys_default",
    "unknown_keys_message",
    "verl_rejection_rule",
]
