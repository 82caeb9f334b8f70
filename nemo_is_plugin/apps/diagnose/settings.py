"""The IS settings diagnose compares: an IS level x a truncation, each one a validated loss config.

A setting *is* a :class:`ClippedPGLossConfig` (so invalid combinations are rejected by the same validators the loss
uses, and the recommended setting prints as a ``loss_fn`` section that validates unchanged).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, get_args

from pydantic import ValidationError

from nemo_is_plugin.config import ISCorrectionLevel, TruncationType
from nemo_is_plugin.loss.config_model import ClippedPGLossConfig

# the config's own vocabularies (each key's choices live on its field), plus "none" for no truncation
IS_LEVELS: tuple[str, ...] = get_args(ISCorrectionLevel)
TRUNCATIONS: tuple[str, ...] = ("none", *get_args(TruncationType))
DEFAULT_TRUNCATIONS: tuple[str, ...] = ("none", "tis", "icepop")

# (low, high) bounds on the weight. Sources: TIS blog / NeMo-RL recipes (tis C=2), OpenRLHF / ProRLv2 (icepop
# [0.5, 5]), ProRLv2.1 (seq-mask-tis [0.999, 1.002]), verl presets (seq-mis [0.5, 2], geo-rs [0.999, 1.001]).
DEFAULT_BOUNDS: dict[str, tuple[float | None, float]] = {
    "tis": (None, 2.0),
    "icepop": (0.5, 5.0),
    "seq-mask-tis": (0.999, 1.002),
    "seq-mis": (0.5, 2.0),
    "geo-rs": (0.999, 1.001),
}


@dataclass(frozen=True)
class Setting:
    """One IS configuration to diagnose. ``config`` holds the IS keys; every other loss key is at its default."""

    name: str
    config: ClippedPGLossConfig

    @property
    def level(self) -> str:
        return self.config.effective_is_level

    @property
    def truncation(self) -> str:
        return self.config.truncated_importance_sampling_type or "none"

    def loss_fn_keys(self) -> dict[str, Any]:
        """The ``loss_fn`` keys to set (those differing from the defaults), in config field order."""
        return self.config.model_dump(exclude_defaults=True)


def make_setting(
    level: str,
    truncation: str = "none",
    *,
    low: float | None = None,
    high: float | None = None,
    veto: float | None = None,
) -> Setting:
    """Build and validate one setting; raises pydantic ``ValidationError`` naming the field for bad combinations."""
    keys: dict[str, Any] = {"use_importance_sampling_correction": True, "is_correction_level": level}
    if truncation != "none":
        keys.update(
            truncated_importance_sampling_type=truncation,
            truncated_importance_sampling_ratio=high,
            truncated_importance_sampling_ratio_min=low,
        )
    if veto is not None:
        keys["importance_sampling_veto_threshold"] = veto
    cfg = ClippedPGLossConfig(**keys)
    return Setting(setting_name(level, truncation, low, high, veto), cfg)


def setting_name(level: str, truncation: str, low: float | None, high: float | None, veto: float | None) -> str:
    name = level
    if truncation != "none":
        name += f"+{truncation}[{_num(0.0 if low is None else low)},{_num(high)}]"
    if veto is not None:
        name += f"+veto[{_num(veto)}]"
    return name


def _num(x: float | None) -> str:
    return "?" if x is None else f"{x:g}"


def settings_grid(
    levels: Sequence[str] = IS_LEVELS,
    truncations: Sequence[str] = DEFAULT_TRUNCATIONS,
    *,
    bounds: Mapping[str, tuple[float | None, float]] | None = None,
    veto: float | None = None,
) -> tuple[list[Setting], list[tuple[str, str]]]:
    """Every valid level x truncation combination, and the (name, reason) of the combinations the config rejects.

    Args:
        levels: IS levels (token, sequence, sequence_mean, cumulative).
        truncations: "none" and/or truncation types; bounds from ``bounds`` (default ``DEFAULT_BOUNDS``).
        veto: add the veto threshold to every setting.
    """
    b = dict(DEFAULT_BOUNDS)
    b.update(bounds or {})
    settings: list[Setting] = []
    skipped: list[tuple[str, str]] = []
    for level in levels:
        if level not in IS_LEVELS:
            raise ValueError(f"unknown IS level {level!r}; expected one of {', '.join(IS_LEVELS)}")
        for trunc in truncations:
            if trunc not in TRUNCATIONS:
                raise ValueError(f"unknown truncation {trunc!r}; expected one of {', '.join(TRUNCATIONS)}")
            low, high = b.get(trunc, (None, None))
            try:
                settings.append(make_setting(level, trunc, low=low, high=high, veto=veto))
            except ValidationError as exc:
                reason = "; ".join(str(e["msg"]).removeprefix("Value error, ") for e in exc.errors())
                skipped.append((setting_name(level, trunc, low, high, veto), reason))
    return settings, skipped


__all__ = [
    "DEFAULT_BOUNDS",
    "DEFAULT_TRUNCATIONS",
    "IS_LEVELS",
    "Setting",
    "TRUNCATIONS",
    "make_setting",
    "settings_grid",
]
