"""What the config's fields are built from: a numeric key's valid interval (:class:`NumericRange`, ``Annotated``
metadata that validates, explains and documents itself), a number that refuses booleans (:data:`Real`), and the KL
estimator vocabulary (:data:`KLType`) that a config key, a rejection rule and ``loss.kl`` share. Imports without torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BeforeValidator, GetCoreSchemaHandler, GetJsonSchemaHandler, ValidationInfo

from nemo_is_plugin.config.errors import ConfigError

if TYPE_CHECKING:
    from pydantic.json_schema import JsonSchemaValue
    from pydantic_core import CoreSchema

# pydantic-core comes with pydantic but is no declared dependency: it is imported where it is used.

# Schulman's estimators of a KL: the values of reference_policy_kl_type and of verl's rejection statistics (a rejection
# rule's statistic also takes prob_diff, config.rejection_rule.RejectionStatistic).
KLType = Literal["k1", "k2", "k3"]

# The error type of a boolean given for a number; it ends in "_type", so it counts as a type error (errors.py).
NUMBER_TYPE_ERROR = "number_type"


def refuse_bool(value: Any, message: str = "Input should be a number, not a boolean") -> Any:
    """pydantic's lax mode reads true as 1.0 for a float field: a boolean where a number belongs is a type error
    (e.g. verl's ``rollout_is_threshold: true``). Numeric strings ("1e-4", as YAML 1.1 reads it) stay accepted."""
    if isinstance(value, bool):
        from pydantic_core import PydanticCustomError

        raise PydanticCustomError(NUMBER_TYPE_ERROR, message)
    return value


# A float field that refuses booleans (every numeric key with a NumericRange refuses them too).
Real = Annotated[float, BeforeValidator(refuse_bool)]


@dataclass(frozen=True)
class NumericRange:
    """The valid interval of one numeric key, why, and what to write instead (docs/config.md, *Valid ranges*).

    Used as ``Annotated[float | None, NumericRange(...)]``: the field then refuses booleans, and a value outside the
    interval (``None``, "off", is never checked) with ``<key>=<value> is outside its valid range <interval>: <why>;
    <fix>``. Field errors come before the model's combination checks, which therefore see only values in range.
    """

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    why: str = ""
    fix: str = ""

    def contains(self, value: float) -> bool:
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return not (self.high is not None and (value >= self.high if self.high_open else value > self.high))

    def interval(self) -> str:
        lo = "(-inf" if self.low is None else ("(" if self.low_open else "[") + f"{self.low:g}"
        hi = "inf)" if self.high is None else f"{self.high:g}" + (")" if self.high_open else "]")
        return f"{lo}, {hi}"

    def _check(self, value: float | None, info: ValidationInfo) -> float | None:
        if value is not None and not self.contains(value):
            raise ConfigError(
                f"{info.field_name}={value:g} is outside its valid range {self.interval()}: {self.why}; {self.fix}"
            )
        return value

    def __get_pydantic_core_schema__(self, source: Any, handler: GetCoreSchemaHandler) -> CoreSchema:
        from pydantic_core import core_schema

        checked = core_schema.with_info_after_validator_function(self._check, handler(source))
        message = f"Input should be a number in {self.interval()}, not a boolean: {self.fix}"
        return core_schema.no_info_before_validator_function(lambda value: refuse_bool(value, message), checked)

    def __get_pydantic_json_schema__(self, schema: CoreSchema, handler: GetJsonSchemaHandler) -> JsonSchemaValue:
        out = handler(schema)
        if self.low is not None:
            out["exclusiveMinimum" if self.low_open else "minimum"] = self.low
        if self.high is not None:
            out["exclusiveMaximum" if self.high_open else "maximum"] = self.high
        return {**out, "why": self.why, "fix": self.fix}
