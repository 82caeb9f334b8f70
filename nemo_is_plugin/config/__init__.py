"""The loss configuration (pydantic v2; no config module imports torch): with the objectives' key sections, the only
place where defaults live.

Modules: ``keys`` (every generic key, one field each: type, default, choices, valid range with why and fix; and
:class:`~nemo_is_plugin.config.keys.KeySection`, what a policy objective's keys are declared as, in its module),
``model`` (:class:`ClippedPGLossConfig`: the generic keys and every registered objective's section, the unknown-key
policy, the combination checks and the derived choices, and
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
from nemo_is_plugin.config.model import NUMERIC_RANGES, ClippedPGLossConfig, PolicyObjective, load_loss_config
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
