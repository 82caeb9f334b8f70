"""The loss configuration (pydantic v2, imports without torch): the only place where defaults live.

Modules: ``model`` (:class:`ClippedPGLossConfig` and :func:`load_loss_config`), ``choices`` (each option's allowed
values), ``rejection_rule`` (:class:`RejectionRule`, verl's ``rollout_rs`` options), ``ranges`` (the valid interval of
every numeric key), ``contradictions`` (the combination checks), ``unknown_keys`` (warn or refuse unknown keys),
``errors`` (the exception and warning types), ``effective`` (every derived choice in words).
"""

from nemo_is_plugin.config.choices import (
    REJECTION_TYPES,
    SEQUENCE_MASK_TYPES,
    TOKEN_AGGREGATIONS,
    ISCorrectionLevel,
    KLGradient,
    KLType,
    LossAggregation,
    OldPolicyLogprobs,
    RatioLevel,
    RejectionType,
    TruncationType,
)
from nemo_is_plugin.config.errors import ConfigError, ConfigValidationError, UnknownConfigKeyWarning
from nemo_is_plugin.config.model import ClippedPGLossConfig, load_loss_config
from nemo_is_plugin.config.ranges import NUMERIC_RANGES, NumericRange
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
    "REJECTION_LOG_RATIO_CLAMP",
    "REJECTION_TYPES",
    "SEQUENCE_MASK_TYPES",
    "STRICT_KEYS_ENV",
    "TOKEN_AGGREGATIONS",
    "VERL_RS_AGGREGATIONS",
    "VERL_RS_OPTIONS",
    "ClippedPGLossConfig",
    "ConfigError",
    "ConfigValidationError",
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
