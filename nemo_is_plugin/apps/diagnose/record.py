"""One JSONL rollout-dump record, validated by a pydantic model; its errors become :class:`DumpError` messages.

The model checks the record's *shape and types* (lists of numbers, numeric scalars, a string config) in strict mode,
so a bool or a string is never read as a number; what depends on several records or on the values themselves (equal
lengths, 0/1 masks, finite unmasked log-probs) is checked once for the whole dump by :func:`dump.build_dump`.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from nemo_is_plugin.apps.diagnose.dump import ALIASES, DumpError

# The largest magnitude a 64-bit signed integer field (step, sample_id) can hold.
_INT64_LIMIT = 2**63


class DumpRecord(BaseModel):
    """One response of a rollout dump, as ``nemo-is diagnose`` reads it (the format: docs/diagnose.md).

    ``null`` inside a list is kept (as NaN: an error only on an unmasked token); unknown keys are ignored, as a host's
    dump may carry more (prompts, texts). The field order is the order in which a bad record's first error is named.
    """

    model_config = ConfigDict(strict=True, extra="ignore")

    generation_logprobs: list[float | None]
    prev_logprobs: list[float | None]
    mask: list[float | bool | None] | None = None
    advantage: float | None = None
    reward: float | None = None
    step: int | float | None = None
    sample_id: int | float | None = None
    config: str | None = None

    @field_validator("mask", mode="before")
    @classmethod
    def _mask_given_as_list(cls, value: Any) -> Any:
        # runs only for a mask that is present: an explicit null is a malformed mask, not "no mask"
        if value is None:
            raise ValueError("not a list")
        return value

    @field_validator("step", "sample_id")
    @classmethod
    def _whole_int64(cls, value: int | float | None) -> int | float | None:
        # a JSON writer may print an integer as 3.0: accepted, as long as it is whole and fits int64
        if value is not None and (abs(value) >= _INT64_LIMIT or not float(value).is_integer()):
            raise ValueError("not a 64-bit integer")
        return value

    def array(self, key: str) -> np.ndarray:
        """A list field as float64, ``null`` as NaN."""
        values = getattr(self, key)
        return np.asarray([math.nan if v is None else float(v) for v in values], dtype=np.float64)

    def scalar(self, key: str) -> Any:
        """A scalar field as the dump stores it: int for step / sample_id, float for the others, the config string."""
        value = getattr(self, key)
        if value is None or key == "config":
            return value
        return int(value) if key in ("step", "sample_id") else float(value)


_LIST_FIELDS = ("generation_logprobs", "prev_logprobs", "mask")


def parse_record(where: str, rec: dict[str, Any]) -> DumpRecord:
    """Validate one decoded JSON object (aliases resolved here); a bad one raises :class:`DumpError` naming ``where``
    and the key."""
    for alias, key in ALIASES.items():
        if alias in rec:
            if key in rec:
                raise DumpError(f"{where}: both '{key}' and its alias '{alias}' are given; keep one")
            rec[key] = rec.pop(alias)
    try:
        return DumpRecord.model_validate(rec)
    except ValidationError as exc:
        raise DumpError(f"{where}: {_describe(exc, rec)}") from None


def _describe(exc: ValidationError, rec: dict[str, Any]) -> str:
    """The first error of ``exc`` in the dump's words."""
    error = exc.errors()[0]
    key, rest = str(error["loc"][0]), error["loc"][1:]
    value = error["input"]
    if error["type"] == "missing":
        aliases = [a for a, k in ALIASES.items() if k == key]
        hint = f" (or its alias '{aliases[0]}')" if aliases else ""
        return f"missing key '{key}'{hint}; present: {sorted(rec)}"
    if key in _LIST_FIELDS:
        if not rest or not isinstance(rest[0], int):
            return f"'{key}' must be a list of numbers, got {type(rec[key]).__name__}"
        if isinstance(value, int) and not isinstance(value, bool):  # an int beyond float64's range
            return f"'{key}' holds a number too large for float64"
        return f"'{key}' element {rest[0]} is {value!r}; expected a number"
    value = rec[key]
    if key == "config":
        return f"'config' must be a string, got {type(value).__name__}"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"'{key}' must be a number, got {value!r}"
    if key in ("step", "sample_id"):
        return f"'{key}' must be an integer (64-bit), got {value!r}"
    return f"'{key}' is too large for float64"  # a JSON integer beyond float64's range


__all__ = ["DumpRecord", "parse_record"]
