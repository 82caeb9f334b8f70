"""The loss configuration (pydantic v2, imports without torch): the only place where defaults live.

Modules: ``keys`` (every key, one field each: type, default, choices, valid range with why and fix), ``model``
(:class:`ClippedPGLossConfig`: the unknown-key policy, the combination checks and the derived choices, and
:func:`load_loss_config`), ``field_types`` (what fields are built from: :class:`NumericRange`, a bool-refusing number,
the KL estimator vocabulary), ``rejection_rule`` (:class:`RejectionRule`, verl's ``rollout_rs`` options),
``contradictions`` (the combination checks), ``unknown_keys`` (warn or refuse unknown keys), ``errors`` (the exception
and warning types), ``effective`` (every derived choice in words).
"""

from nemo_is_plugin.config.errors import (
    ConfigError,
    ConfigTypeError,
    ConfigValidationError,
    ConfigValidationTypeError,
    UnknownConfigKeyWarning,
)
from nemo_is_plugin.config.field_types import KLType, NumericRange
from nemo_is_plugin.config.keys import (
    NUMERIC_RANGES,
    OTHER_OBJECTIVES,
    REJECTION_TYPES,
    SEQUENCE_MASK_TYPES,
    TOKEN_AGGREGATIONS,
    ISCorrectionLevel,
    KLGradient,
    LossAggregation,
    OldPolicyLogprobs,
    PolicyObjective,
    RatioLevel,
    RejectionType,
    TruncationType,
)
from nemo_is_plugin.config.model import ClippedPGLossConfig, load_loss_config
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
    strict_keys_default,
    unknown_keys_message,
)

__all__ = [
    "NUMERIC_RANGES",
    "OTHER_OBJECTIVES",
    "REJECTION_LOG_RATIO_CLAMP",
    "PolicyObjective",
    "REJECTION_TYPES",
    "SEQUENCE_MASK_TYPES",
    "STRICT_KEYS_ENV",
    "TOKEN_AGGREGATIONS",
    "VERL_RS_AGGREGATIONS",
    "VERL_RS_OPTIONS",
    "ClippedPGLossConfig",
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
    "RejectionType",
    "TruncationType",
    "UnknownConfigKeyWarning",
    "check_unknown_keys",
    "load_loss_config",
    "strict_keys_default",
    "unknown_keys_message",
    "verl_rejection_rule",
]
