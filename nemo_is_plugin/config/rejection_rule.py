"""Rejection rules: keep a token or a sequence only while a divergence between pi_prev and mu stays in bounds: a
KL-type statistic of log(pi_prev / mu), or the probability difference |pi_prev - mu| per token.

One criterion per :class:`RejectionRule`; several at once must all pass. verl's ``rollout_rs`` options are accepted as
aliases (:func:`verl_rejection_rule` parses them as verl does). Imports without torch.
"""

from __future__ import annotations

import math
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, model_validator

from nemo_is_plugin.config.errors import ConfigError, ConfigTypeError
from nemo_is_plugin.config.field_types import KLType, Real

# The three KL estimators of log(pi_prev / mu), and the total-variation term |pi_prev - mu| of the sampled token
# (prime-rl's probability-difference mask, here between pi_prev and mu). verl's rollout_rs has the three KL ones only.
RejectionStatistic = Literal["k1", "k2", "k3", "prob_diff"]
RejectionAggregation = Literal["token", "sequence_sum", "sequence_mean", "sequence_max"]
# verl's rollout_rs option prefixes -> the plugin's aggregations. verl has no seq_max_k1 (the plugin has).
VERL_RS_AGGREGATIONS = {
    "token": "token",
    "seq_sum": "sequence_sum",
    "seq_mean": "sequence_mean",
    "seq_max": "sequence_max",
}
VERL_RS_OPTIONS: tuple[str, ...] = tuple(
    f"{prefix}_{stat}"
    for prefix in VERL_RS_AGGREGATIONS
    for stat in get_args(KLType)
    if (prefix, stat) != ("seq_max", "k1")
)
REJECTION_LOG_RATIO_CLAMP = 20.0  # verl clamps log(pi_old / mu) to +-20 before its rejection statistics


def verl_rejection_rule(option: str, threshold: Any) -> dict[str, Any]:
    """One verl ``rollout_rs`` option with its ``rollout_rs_threshold`` entry -> :class:`RejectionRule` fields.

    Parsed as verl parses it: k1 options take ``"lo_hi"`` or one number u (lo = 1/u) and keep
    ``log(lo) <= k1 <= log(hi)`` (verl's code bounds k1 = -log(pi_old/mu), i.e. the inverse ratio, although its docs
    describe [lo, hi] as bounds on pi_old/mu; the rule reproduces the code). k2 / k3 options take one upper bound.
    """
    opt = str(option).strip()
    if opt not in VERL_RS_OPTIONS:
        hint = " (prob_diff is the plugin's: write {statistic: prob_diff, aggregation: ..., max: ...})"
        raise ConfigError(
            f"rollout_rs option {opt!r} is not one of verl's: {', '.join(VERL_RS_OPTIONS)}"
            + (hint if "prob_diff" in opt else "")
        )
    prefix, stat = opt.rsplit("_", 1)
    if threshold is None:
        raise ConfigError(f"rollout_rs option {opt!r} needs a numeric rollout_rs_threshold, got None")
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float, str)):
        raise ConfigTypeError(f"rollout_rs option {opt!r} needs a numeric rollout_rs_threshold, got {threshold!r}")
    spec = str(threshold).strip()
    rule: dict[str, Any] = {"statistic": stat, "aggregation": VERL_RS_AGGREGATIONS[prefix]}
    if stat == "k1":
        lo_text, hi_text = spec.split("_", 1) if "_" in spec else (None, spec)
        hi = _positive_number(hi_text, opt)
        lo = 1.0 / hi if lo_text is None else _positive_number(lo_text, opt)
        if lo > hi:
            raise ConfigError(f"rollout_rs_threshold {spec!r} for {opt!r} must be lower_upper with lower <= upper")
        return {**rule, "min": math.log(lo), "max": math.log(hi)}
    if "_" in spec:
        raise ConfigError(
            f"rollout_rs_threshold for option {opt!r} must provide a single upper bound without '_' "
            f"({stat} is a divergence >= 0), got {spec!r}"
        )
    return {**rule, "max": _positive_number(spec, opt)}


def _positive_number(text: str, option: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ConfigError(f"rollout_rs_threshold for {option!r}: {text!r} is not a number") from None
    if not value > 0 or math.isinf(value):
        raise ConfigError(f"rollout_rs_threshold for {option!r} must be a finite positive number, got {text!r}")
    return value


class RejectionRule(BaseModel):
    """Keep a token (aggregation ``token``) or a whole sequence only while ``min <= statistic <= max``.

    Statistics of y_t = clamp(p_t - g_t, +-log_ratio_clamp) = log(pi_prev / mu) per token, the three estimators of
    KL(mu || pi_prev): k1 = -y, k2 = y^2 / 2, k3 = e^y - 1 - y; or ``prob_diff`` = |e^p_t - e^g_t|, the probability
    difference (a total-variation term) of the token, unclamped; aggregated per token, or over the sequence's unmasked
    tokens as a sum, a mean or a max (a sequence without tokens has statistic 0). k2, k3 and prob_diff are >= 0, so
    only ``max`` bounds them; prob_diff is <= 1, so its ``max`` lies in (0, 1]. Aliases: verl's form
    ``{option: seq_mean_k1, threshold: "0.999_1.001"}``, and verl's aggregation names ``seq_sum`` / ``seq_mean`` /
    ``seq_max``.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    statistic: RejectionStatistic
    aggregation: RejectionAggregation
    min: Real | None = Field(None, description="Lower bound of the aggregated statistic (k1 only).")
    max: Real | None = Field(None, description="Upper bound of the aggregated statistic.")
    log_ratio_clamp: Real | None = Field(
        REJECTION_LOG_RATIO_CLAMP,
        gt=0,
        description="Clamp of y_t to +-value before the statistic (verl: 20); null: no clamp, non-finite y_t count 0. "
        "prob_diff reads no y_t: null for it.",
    )

    @model_validator(mode="before")
    @classmethod
    def _verl_form(cls, data: Any) -> Any:
        if isinstance(data, str):
            raise ConfigTypeError(
                f"rejection rule {data!r} has no bounds: write {{option: {data}, threshold: ...}} "
                "(verl's form) or {statistic: ..., aggregation: ..., max: ...}"
            )
        if isinstance(data, dict) and "option" in data:
            rest = {k: v for k, v in data.items() if k not in ("option", "threshold")}
            return {**verl_rejection_rule(data["option"], data.get("threshold")), **rest}
        if isinstance(data, dict) and data.get("aggregation") in VERL_RS_AGGREGATIONS:  # verl's seq_sum, ... names
            data = {**data, "aggregation": VERL_RS_AGGREGATIONS[data["aggregation"]]}
        if isinstance(data, dict) and data.get("statistic") == "prob_diff":
            # |e^p - e^g| reads the log-probs, not their clamped difference: no clamp applies, so the field is null
            # (a dumped rule round-trips) and a clamp given for it is refused rather than ignored.
            if data.get("log_ratio_clamp") is not None:
                raise ConfigError(
                    f"rejection rule {data.get('aggregation')}_prob_diff: log_ratio_clamp="
                    f"{data['log_ratio_clamp']!r} does not apply (|pi_prev - mu| reads the probabilities, not the "
                    "log-ratio); unset it"
                )
            data = {**data, "log_ratio_clamp": None}
        return data

    @model_validator(mode="after")
    def _check_bounds(self) -> RejectionRule:
        lo, hi = self.min, self.max
        if self.statistic != "k1" and lo is not None:
            raise ConfigError(
                f"rejection rule {self.name}: {self.statistic} is a divergence >= 0, only max bounds it; unset min"
            )
        if self.statistic == "prob_diff" and hi is not None and not 0 < hi <= 1:
            raise ConfigError(
                f"rejection rule {self.name}: max={hi} must be in (0, 1] (|pi_prev - mu| of a token lies in [0, 1]; "
                "prime-rl's ipo_threshold is 0.1)"
            )
        if hi is None and (lo is None or self.statistic != "k1"):
            also = " and/or min" if self.statistic == "k1" else ""
            raise ConfigError(f"rejection rule {self.name} needs max{also}")
        if self.statistic != "k1" and hi is not None and hi <= 0:
            raise ConfigError(f"rejection rule {self.name}: max={hi} must be > 0 ({self.statistic} >= 0 everywhere)")
        if lo is not None and hi is not None and lo > hi:
            raise ConfigError(f"rejection rule {self.name}: min={lo} must be <= max={hi}")
        return self

    @property
    def name(self) -> str:
        """``<aggregation>_<statistic>``, e.g. ``sequence_mean_k3``: the rule's metric names use it."""
        return f"{self.aggregation}_{self.statistic}"

    @property
    def verl_option(self) -> str | None:
        """verl's ``rollout_rs`` option computing the same statistic (clamp included), else None."""
        prefix = {v: k for k, v in VERL_RS_AGGREGATIONS.items()}[self.aggregation]
        option = f"{prefix}_{self.statistic}"
        return option if option in VERL_RS_OPTIONS and self.log_ratio_clamp == REJECTION_LOG_RATIO_CLAMP else None

    @classmethod
    def from_band(cls, kind: str, low: float, high: float) -> RejectionRule:
        """``seq-mis`` / ``geo-rs`` with a ratio band [low, high] on exp(sum_t x_t) / exp(mean_t x_t), as a k1 rule
        (k1 = -log ratio, so the band becomes [-log high, -log low]); unclamped, as those shorthands always were."""
        aggregation: RejectionAggregation = "sequence_sum" if kind == "seq-mis" else "sequence_mean"
        return cls(
            statistic="k1", aggregation=aggregation, min=-math.log(high), max=-math.log(low), log_ratio_clamp=None
        )
