"""The config's error and warning types: one exception type for every invalid config, one warning for unknown keys.

Imports without torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import ValidationError

if TYPE_CHECKING:
    from pydantic_core import InitErrorDetails  # a TypedDict: a type only (pydantic-core comes with pydantic)


class ConfigError(ValueError):
    """Raised for a configuration contradiction; pydantic wraps it into a ValidationError naming the fields."""


class ConfigValidationError(ValidationError, ConfigError, AssertionError):
    """An invalid loss config: what :class:`ClippedPGLossConfig` (and every loss / adapter constructor) raises.

    It is pydantic's ``ValidationError`` (its message names each field, ``errors()`` lists them), a ``ValueError``
    and a :class:`ConfigError`, and an ``AssertionError``, the type NeMo-RL's ``ClippedPGLossFn`` raises for invalid
    combinations, so code written against either catches it.
    """

    @classmethod
    def wrap(cls, exc: ValidationError) -> ConfigValidationError:
        if isinstance(exc, cls):
            return exc
        details: list[InitErrorDetails] = []
        for e in exc.errors(include_url=False):
            detail: InitErrorDetails = {"type": e["type"], "loc": e["loc"], "input": e["input"]}
            if "ctx" in e:
                detail["ctx"] = e["ctx"]
            details.append(detail)
        return cls.from_exception_data(exc.title, details)


class UnknownConfigKeyWarning(UserWarning):
    """A ``loss_fn`` key that no field of :class:`ClippedPGLossConfig` reads (ignored unless strict)."""
