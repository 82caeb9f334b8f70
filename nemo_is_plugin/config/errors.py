"""The config's error and warning types: one exception type for every invalid config (with a TypeError flavour for
values of the wrong type), one warning for unknown keys, one for a
third-party objective that failed to load. Imports without torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, get_args

from pydantic import ValidationError

if TYPE_CHECKING:
    from pydantic_core import ErrorDetails, InitErrorDetails  # TypedDicts: types only


class ConfigError(ValueError):
    """Raised for a configuration contradiction; pydantic wraps it into a ValidationError naming the fields."""


class ConfigTypeError(ConfigError, TypeError):
    """A setting of the wrong type (a boolean where a number belongs, a number where a mapping belongs, ...): a
    ``TypeError``, as Python and verl raise for it, and a :class:`ConfigError` like every other refusal."""


class ConfigValidationError(ValidationError, ConfigError, AssertionError):
    """An invalid loss config: what :class:`ClippedPGLossConfig` (and every loss / adapter constructor) raises.

    It is pydantic's ``ValidationError`` (its message names each field, ``errors()`` lists them), a ``ValueError``
    and a :class:`ConfigError`, and an ``AssertionError``, the type NeMo-RL's ``ClippedPGLossFn`` raises for invalid
    combinations, so code written against either catches it. When a setting has the wrong type it is a
    :class:`ConfigValidationTypeError`, also a ``TypeError``.
    """

    @classmethod
    def wrap(cls, exc: ValidationError) -> ConfigValidationError:
        """``exc`` as a :class:`ConfigValidationError`, a :class:`ConfigValidationTypeError` if any of its errors is
        a type error; each error (type, location, input, message) is kept."""
        # pydantic-core comes with pydantic but is no declared dependency: imported where it is used
        from pydantic_core import PydanticCustomError
        from pydantic_core.core_schema import ErrorType

        if isinstance(exc, ConfigValidationError):
            return exc
        errors = exc.errors(include_url=False)
        details: list[InitErrorDetails] = []
        for e in errors:
            known = e["type"] in get_args(ErrorType)  # pydantic rebuilds its own messages; ours are kept as written
            detail: InitErrorDetails = {
                "type": e["type"] if known else PydanticCustomError(e["type"], e["msg"]),
                "loc": e["loc"],
                "input": e["input"],
            }
            if known and "ctx" in e:
                detail["ctx"] = e["ctx"]
            details.append(detail)
        kind = ConfigValidationTypeError if any(map(is_type_error, errors)) else ConfigValidationError
        return kind.from_exception_data(exc.title, details)


class ConfigValidationTypeError(ConfigValidationError, ConfigTypeError):
    """An invalid loss config in which some setting has the wrong type: a :class:`ConfigValidationError` that is
    also a ``TypeError`` (e.g. ``rollout_is_threshold: true``, or a boolean for any numeric key)."""


def is_type_error(error: ErrorDetails | dict[str, Any]) -> bool:
    """Whether one pydantic error is about the input's type: pydantic's ``*_type`` / ``*_parsing`` errors (a bool for
    a number, "abc" for a float, a string for a list, ...), or a :class:`ConfigTypeError` raised by a validator."""
    kind = str(error["type"])
    return kind.endswith(("_type", "_parsing")) or isinstance((error.get("ctx") or {}).get("error"), TypeError)


class UnknownConfigKeyWarning(UserWarning):
    """A ``loss_fn`` key that no field of :class:`ClippedPGLossConfig` reads (ignored unless strict)."""


class ObjectiveEntryPointWarning(UserWarning):
    """An installed package's policy-objective entry point that failed to load: its objectives are unavailable, the
    configs that do not name them are unaffected (a config naming one is refused, saying why)."""
