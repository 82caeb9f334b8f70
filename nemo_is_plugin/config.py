"""The loss configuration: NeMo-RL's ``loss_fn`` keys, plus independent IS / ratio / clip / KL / aggregation choices.

This module imports without torch. It is the only place where defaults live. Every NeMo-RL ``ClippedPGLossConfig``
key is accepted with NeMo-RL's name, type and default, so an existing NeMo-RL ``loss_fn`` section validates unchanged.
The new fields default to ``None`` / off, in which case the loss reproduces NeMo-RL's ``ClippedPGLossFn``.

Formulas (p = prev_logprobs, g = generation_logprobs, c = current log-probs, m = token mask, t = 1-based position among
unmasked tokens):

- ratio_level (policy ratio pi_theta / pi_old):
    token            r_t = exp(c_t - p_t)                                   (PPO / GRPO)
    sequence         r_i = exp(sum_t m_t (c_t - p_t) / sum_t m_t)           (GSPO; one ratio per sequence)
    sequence_token   r_it = sg[r_i] * exp(c_t - sg[c_t])                    (GSPO-token; gradient through token t)
    cumulative       r_it = exp(sg[sum_{j<=t} m_j (c_j - p_j)] + c_t - sg[c_t])   (CTPO cumprod)
    cumulative_mean  as cumulative with the prefix sum divided by t         (CTPO geomean)
- is_correction_level (IS weight pi_prev / pi_gen, always detached):
    token            w_t = exp(p_t - g_t)
    sequence         w_i = exp(sum_t m_t (p_t - g_t))                       (NeMo-RL GSPO default; collapses when long)
    sequence_mean    w_i = exp(sum_t m_t (p_t - g_t) / sum_t m_t)          (PR #2269 geometric mean)
    cumulative       w_it = exp(sum_{j<=t} m_j (p_j - g_j))                 (prefix correction; no framework has it)
- log-space clip (CTPO), when log_ratio_clip_low/high are set:
    clipped ratio = exp(clamp(log r, -eps_low * t^power, eps_high * t^power)); dual clip c_t = exp(eps_c * t^power).
- rejection rules (verl's rollout_rs): keep a token / sequence while min <= agg_t k(y_t) <= max, y = clamp(p - g, +-20),
    k1 = -y, k2 = y^2 / 2, k3 = e^y - 1 - y, agg = per token | sequence sum | mean | max (RejectionRule).
"""

from __future__ import annotations

import difflib
import math
import os
import warnings
from contextvars import ContextVar
from typing import Any, Literal, Optional, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from nemo_is_plugin.config_ranges import NUMERIC_RANGES, range_errors  # noqa: F401 - NUMERIC_RANGES re-exported

RatioLevel = Literal["token", "sequence", "sequence_token", "cumulative", "cumulative_mean"]
ISCorrectionLevel = Literal["token", "sequence", "sequence_mean", "cumulative"]
TruncationType = Literal["tis", "icepop", "seq-mask-tis", "seq-mis", "geo-rs"]
RejectionType = Literal["seq-mis", "geo-rs"]
KLType = Literal["k1", "k2", "k3"]
KLGradient = Literal["estimator", "k2"]
LossAggregation = Literal[
    "token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"
]

# Aggregations without a per-sequence normalisation: NeMo-RL's token_level_loss=true.
TOKEN_AGGREGATIONS = ("token-mean", "token-sum")
# Truncation types that reject whole sequences instead of reweighting tokens; they may run without IS weights.
REJECTION_TYPES: tuple[str, ...] = get_args(RejectionType)
# Truncation types that mask whole sequences by a sequence statistic.
SEQUENCE_MASK_TYPES = ("seq-mask-tis", *REJECTION_TYPES)


class ConfigError(ValueError):
    """Raised for a configuration contradiction; pydantic wraps it into a ValidationError naming the fields."""


# ---------------------------------------------------------------------------------------------------------------------
# Rejection rules: one criterion each, several at once must all pass (verl's rollout_rs options are aliases).
# ---------------------------------------------------------------------------------------------------------------------

RejectionStatistic = Literal["k1", "k2", "k3"]
RejectionAggregation = Literal["token", "sequence_sum", "sequence_mean", "sequence_max"]
OldPolicyLogprobs = Literal["prev", "generation"]
# verl's rollout_rs option prefixes -> the plugin's aggregations. verl has no seq_max_k1 (the plugin has).
VERL_RS_AGGREGATIONS = {"token": "token", "seq_sum": "sequence_sum", "seq_mean": "sequence_mean",
                        "seq_max": "sequence_max"}
VERL_RS_OPTIONS: tuple[str, ...] = tuple(
    f"{prefix}_{stat}" for prefix in VERL_RS_AGGREGATIONS for stat in get_args(RejectionStatistic)
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
        raise ConfigError(f"rollout_rs option {opt!r} is not one of verl's: {', '.join(VERL_RS_OPTIONS)}")
    prefix, stat = opt.rsplit("_", 1)
    if threshold is None or isinstance(threshold, bool):
        raise ConfigError(f"rollout_rs option {opt!r} needs a numeric rollout_rs_threshold, got {threshold!r}")
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
        raise ConfigError(f"rollout_rs_threshold for option {opt!r} must provide a single upper bound without '_' "
                          f"({stat} is a divergence >= 0), got {spec!r}")
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
    KL(mu || pi_prev): k1 = -y, k2 = y^2 / 2, k3 = e^y - 1 - y; aggregated per token, or over the sequence's unmasked
    tokens as a sum, a mean or a max (a sequence without tokens has statistic 0). k2 and k3 are >= 0, so only ``max``
    bounds them. Aliases: verl's form ``{option: seq_mean_k1, threshold: "0.999_1.001"}``, and verl's aggregation names
    ``seq_sum`` / ``seq_mean`` / ``seq_max``.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    statistic: RejectionStatistic
    aggregation: RejectionAggregation
    min: Optional[float] = Field(None, description="Lower bound of the aggregated statistic (k1 only).")
    max: Optional[float] = Field(None, description="Upper bound of the aggregated statistic.")
    log_ratio_clamp: Optional[float] = Field(
        REJECTION_LOG_RATIO_CLAMP, gt=0,
        description="Clamp of y_t to +-value before the statistic (verl: 20); null: no clamp, non-finite y_t count 0.",
    )

    @model_validator(mode="before")
    @classmethod
    def _verl_form(cls, data: Any) -> Any:
        if isinstance(data, str):
            raise ConfigError(f"rejection rule {data!r} has no bounds: write {{option: {data}, threshold: ...}} "
                              "(verl's form) or {statistic: ..., aggregation: ..., max: ...}")
        if isinstance(data, dict) and "option" in data:
            rest = {k: v for k, v in data.items() if k not in ("option", "threshold")}
            return {**verl_rejection_rule(data["option"], data.get("threshold")), **rest}
        if isinstance(data, dict) and data.get("aggregation") in VERL_RS_AGGREGATIONS:  # verl's seq_sum, ... names
            return {**data, "aggregation": VERL_RS_AGGREGATIONS[data["aggregation"]]}
        return data

    @model_validator(mode="after")
    def _check_bounds(self) -> "RejectionRule":
        lo, hi = self.min, self.max
        if self.statistic != "k1" and lo is not None:
            raise ConfigError(f"rejection rule {self.name}: {self.statistic} is a divergence >= 0, only max bounds it; "
                              "unset min")
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
    def verl_option(self) -> Optional[str]:
        """verl's ``rollout_rs`` option computing the same statistic (clamp included), else None."""
        prefix = {v: k for k, v in VERL_RS_AGGREGATIONS.items()}[self.aggregation]
        option = f"{prefix}_{self.statistic}"
        return option if option in VERL_RS_OPTIONS and self.log_ratio_clamp == REJECTION_LOG_RATIO_CLAMP else None

    @classmethod
    def from_band(cls, kind: str, low: float, high: float) -> "RejectionRule":
        """``seq-mis`` / ``geo-rs`` with a ratio band [low, high] on exp(sum_t x_t) / exp(mean_t x_t), as a k1 rule
        (k1 = -log ratio, so the band becomes [-log high, -log low]); unclamped, as those shorthands always were."""
        aggregation = "sequence_sum" if kind == "seq-mis" else "sequence_mean"
        return cls(statistic="k1", aggregation=aggregation, min=-math.log(high), max=-math.log(low),
                   log_ratio_clamp=None)


class ConfigValidationError(ValidationError, ConfigError, AssertionError):
    """An invalid loss config: what :class:`ClippedPGLossConfig` (and every loss / adapter constructor) raises.

    It is pydantic's ``ValidationError`` (its message names each field, ``errors()`` lists them), a ``ValueError``
    and a :class:`ConfigError`, and an ``AssertionError``, the type NeMo-RL's ``ClippedPGLossFn`` raises for invalid
    combinations, so code written against either catches it.
    """

    @classmethod
    def wrap(cls, exc: ValidationError) -> "ConfigValidationError":
        if isinstance(exc, cls):
            return exc
        details = [
            {"type": e["type"], "loc": e["loc"], "input": e["input"], **({"ctx": e["ctx"]} if "ctx" in e else {})}
            for e in exc.errors(include_url=False)
        ]
        return cls.from_exception_data(exc.title, details)


class UnknownConfigKeyWarning(UserWarning):
    """A ``loss_fn`` key that no field of :class:`ClippedPGLossConfig` reads (ignored unless strict)."""


# Truthy value of this variable makes unknown keys an error everywhere (NeMo-RL builds the loss itself, so a constructor
# flag would not reach it); ``load_loss_config(..., strict=...)`` decides per call.
STRICT_KEYS_ENV = "NEMO_IS_STRICT_CONFIG"


# Set for the duration of one validation by ``load_loss_config(strict=...)`` / ``model_validate(context=...)``
# (the custom ``__init__`` makes pydantic drop the validation context, so the flag travels here).
_STRICT_KEYS: ContextVar[Optional[bool]] = ContextVar("nemo_is_strict_keys", default=None)


def strict_keys_default() -> bool:
    """Whether unknown keys are an error when the caller does not say: ``NEMO_IS_STRICT_CONFIG`` is 1/true/yes/on."""
    return os.environ.get(STRICT_KEYS_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def unknown_keys_message(unknown: list[str], known: set[str], section: str = "loss_fn") -> str:
    """``unknown <section> key(s): 'x' (did you mean 'y'?), ...`` with the nearest valid key of each."""
    hints = []
    for key in unknown:
        near = difflib.get_close_matches(str(key), sorted(known), n=1, cutoff=0.5)
        hints.append(f"'{key}'" + (f" (did you mean '{near[0]}'?)" if near else ""))
    return f"unknown {section} key(s): " + ", ".join(hints)


def check_unknown_keys(unknown: list[str], known: set[str], *, strict: bool, section: str = "loss_fn") -> None:
    """The unknown-key policy: an error (``ConfigError``) when ``strict``, else an :class:`UnknownConfigKeyWarning`.

    NeMo-RL's own config model accepts extra keys, so a section NeMo-RL runs with must not be refused by default.
    """
    if not unknown:
        return
    message = unknown_keys_message(unknown, known, section)
    if strict:
        raise ConfigError(
            message + ". Valid keys are the NeMo-RL ClippedPGLossConfig keys and the plugin keys listed in "
            f"docs/config.md (strict mode: unset {STRICT_KEYS_ENV} to only warn)."
        )
    warnings.warn(
        message + f"; they are ignored (NeMo-RL accepts extra keys). Set {STRICT_KEYS_ENV}=1 to make this an error.",
        UnknownConfigKeyWarning, stacklevel=2,
    )


class ClippedPGLossConfig(BaseModel):
    """Configuration of :class:`nemo_is_plugin.loss.ClippedPGLoss`.

    The first block is NeMo-RL's ``ClippedPGLossConfig`` (commit 7ea279ab), unchanged. The second block holds the
    plugin's independent choices; see ``docs/config.md`` for each formula.
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    # ---- NeMo-RL keys (names, types and defaults as in NeMo-RL) ----
    reference_policy_kl_penalty: float = 0.01
    reference_policy_kl_type: str = "k3"
    kl_input_clamp_value: Optional[float] = 20.0
    kl_output_clamp_value: Optional[float] = 10.0
    ratio_clip_min: float = 0.2
    ratio_clip_max: float = 0.2
    ratio_clip_c: Optional[float] = None
    use_on_policy_kl_approximation: bool = False
    use_importance_sampling_correction: bool = False
    truncated_importance_sampling_type: Optional[str] = None
    truncated_importance_sampling_ratio: Optional[float] = None
    truncated_importance_sampling_ratio_min: Optional[float] = None
    token_level_loss: bool = True
    sequence_level_importance_ratios: bool = False
    force_on_policy_ratio: bool = False
    use_kl_in_reward: bool = False
    disable_ppo_ratio: bool = False
    use_cispo: bool = False
    positive_example_nll_weight: float = 0.0

    # ---- plugin choices (None / off reproduces NeMo-RL) ----
    ratio_level: Optional[RatioLevel] = Field(
        None, description="Policy-ratio level; None derives it from sequence_level_importance_ratios like NeMo-RL."
    )
    is_correction_level: Optional[ISCorrectionLevel] = Field(
        None, description="IS-weight level; None derives it from sequence_level_importance_ratios like NeMo-RL."
    )
    log_ratio_clip_low: Optional[float] = Field(
        None, description="eps_low of the log-space clip: log r >= -eps_low * t^clip_position_power."
    )
    log_ratio_clip_high: Optional[float] = Field(
        None, description="eps_high of the log-space clip: log r <= eps_high * t^clip_position_power."
    )
    log_ratio_clip_c: Optional[float] = Field(
        None, description="Log-space dual clip: for A < 0 the loss is capped at -A * exp(eps_c * t^power)."
    )
    clip_position_power: float = Field(
        0.0, description="p in the position-adaptive bounds eps * t^p (CTPO uses 0.5); 0 gives fixed bounds."
    )
    token_log_ratio_clamp: Optional[float] = Field(
        None, description="Clamp each token log-ratio c_t - p_t to +-value before building the ratio (CTPO: 20)."
    )
    max_log_ratio: Optional[float] = Field(
        None, description="Upper cap on the log of the policy ratio after building it (CTPO: 10)."
    )
    importance_sampling_rejection: Optional[RejectionType] = Field(
        None, description="Sequence rejection on top of the truncation type: 'seq-mis' (exp(sum_t x_t)) or 'geo-rs' "
        "(exp(mean_t x_t)) outside [importance_sampling_rejection_min, _max] zeroes the sequence (verl's "
        "Seq-MIS / Geo-RS + TIS presets).",
    )
    importance_sampling_rejection_min: Optional[float] = Field(
        None, description="Lower bound of the rejection band (ratio space)."
    )
    importance_sampling_rejection_max: Optional[float] = Field(
        None, description="Upper bound of the rejection band (ratio space)."
    )
    importance_sampling_veto_threshold: Optional[float] = Field(
        None, description="Reject a sequence if any token weight exp(p_t - g_t) is below this (veto)."
    )
    importance_sampling_batch_normalize: bool = Field(
        False, description="Divide IS weights by their masked mean over the batch (after truncation)."
    )
    reference_policy_kl_gradient: KLGradient = Field(
        "estimator", description="'k2': straight-through KL whose value is the chosen estimator and gradient is k2's."
    )
    loss_aggregation: Optional[LossAggregation] = Field(
        None, description="Loss aggregation; None derives it from token_level_loss like NeMo-RL."
    )
    loss_aggregation_norm: Optional[float] = Field(
        None, description="Constant divisor per sequence for seq-mean-token-sum-norm (e.g. max response length)."
    )

    # ---- rejection rules and the old policy (verl's rollout_rs / bypass_mode in the plugin's vocabulary) ----
    importance_sampling_rejection_rules: list[RejectionRule] = Field(
        default_factory=list, description="Rejection criteria that must all pass (verl's rollout_rs): a token or "
        "sequence failing one gets weight 0, after truncation and batch normalisation. See RejectionRule.",
    )
    old_policy_logprobs: OldPolicyLogprobs = Field(
        "prev", description="pi_old of the policy ratio: 'prev' (three policies) or 'generation' (verl's bypass_mode: "
        "r = pi_theta / mu, and the IS weights / rejections measure the current policy, detached, against mu).",
    )
    strict_input_checks: bool = Field(
        False, description="Raise on non-finite generation log-probs and on positive log-probs (above the dtype's "
        "rounding tolerance) instead of computing them as NeMo-RL does and reporting them in the input_* metrics.",
    )

    # ------------------------------------------------------------------ construction: one exception type
    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise ConfigValidationError.wrap(exc) from None

    @classmethod
    def model_validate(cls, obj: Any, **kwargs: Any) -> "ClippedPGLossConfig":
        """pydantic's ``model_validate``; ``context={"strict_keys": True}`` makes unknown keys an error."""
        token = _STRICT_KEYS.set((kwargs.get("context") or {}).get("strict_keys"))
        try:
            return super().model_validate(obj, **kwargs)
        except ValidationError as exc:
            raise ConfigValidationError.wrap(exc) from None
        finally:
            _STRICT_KEYS.reset(token)

    def __setattr__(self, name: str, value: Any) -> None:
        try:
            super().__setattr__(name, value)
        except ValidationError as exc:
            raise ConfigValidationError.wrap(exc) from None

    # ------------------------------------------------------------------ validation
    @model_validator(mode="before")
    @classmethod
    def _drop_unknown_keys(cls, data: Any) -> Any:
        if isinstance(data, dict):
            known = set(cls.model_fields)
            unknown = [k for k in data if k not in known]
            if unknown:
                strict = _STRICT_KEYS.get()
                check_unknown_keys(unknown, known, strict=strict_keys_default() if strict is None else bool(strict))
                data = {k: v for k, v in data.items() if k in known}
        return data

    @model_validator(mode="after")
    def _check_combinations(self) -> "ClippedPGLossConfig":
        # token_level_loss follows an explicit loss_aggregation unless the user set both (then they must agree), so
        # that a model_dump() reloads unchanged.
        if self.loss_aggregation is not None and "token_level_loss" not in self.model_fields_set:
            self.__dict__["token_level_loss"] = self.loss_aggregation in TOKEN_AGGREGATIONS
        # Out-of-range values first and alone: the combination checks below compare values that must be in range.
        errors = range_errors(self) or [msg for msg in _contradictions(self) if msg]
        if errors:
            raise ConfigError("; ".join(errors))
        return self

    # ------------------------------------------------------------------ derived choices
    @property
    def effective_ratio_level(self) -> RatioLevel:
        if self.ratio_level is not None:
            return self.ratio_level
        return "sequence" if self.sequence_level_importance_ratios else "token"

    @property
    def effective_is_level(self) -> ISCorrectionLevel:
        if self.is_correction_level is not None:
            return self.is_correction_level
        return "sequence" if self.sequence_level_importance_ratios else "token"

    @property
    def effective_loss_aggregation(self) -> LossAggregation:
        if self.loss_aggregation is not None:
            return self.loss_aggregation
        return "token-mean" if self.token_level_loss else "seq-mean-token-mean"

    @property
    def effective_kl_penalty(self) -> float:
        """NeMo-RL puts the KL into the reward when use_kl_in_reward is set, so the loss's penalty is 0."""
        return 0.0 if self.use_kl_in_reward else self.reference_policy_kl_penalty

    @property
    def uses_log_space_clip(self) -> bool:
        return self.log_ratio_clip_low is not None or self.log_ratio_clip_high is not None

    @property
    def rejection_rules(self) -> tuple[RejectionRule, ...]:
        """Every rejection rule: ``importance_sampling_rejection`` (a k1 rule) first, then the listed rules."""
        rules = tuple(self.importance_sampling_rejection_rules)
        lo, hi = self.importance_sampling_rejection_min, self.importance_sampling_rejection_max
        # An incomplete or inverted band is reported by the config check, not here.
        if self.importance_sampling_rejection is not None and lo is not None and hi is not None and lo <= hi:
            rules = (RejectionRule.from_band(self.importance_sampling_rejection, lo, hi), *rules)
        return rules

    @property
    def bypasses_prev(self) -> bool:
        """True when the generation log-probs are pi_old (verl's bypass mode)."""
        return self.old_policy_logprobs == "generation"


def _contradictions(cfg: ClippedPGLossConfig) -> list[str]:
    """Every contradiction NeMo-RL rejects, plus the plugin's own; each message names the fields and the fix."""
    out: list[str] = []
    tis = cfg.truncated_importance_sampling_type
    lo, hi = cfg.truncated_importance_sampling_ratio_min, cfg.truncated_importance_sampling_ratio
    gspo = cfg.sequence_level_importance_ratios

    if cfg.reference_policy_kl_type not in ("k1", "k2", "k3"):
        out.append(f"reference_policy_kl_type={cfg.reference_policy_kl_type!r} is not one of 'k1', 'k2', 'k3'")
    if gspo and cfg.token_level_loss:
        out.append(
            "sequence-level importance sampling (e.g. GSPO) is mutually exclusive with token-level loss: "
            "sequence_level_importance_ratios=true requires token_level_loss: false"
        )
    if tis is not None:
        if tis not in get_args(TruncationType):
            out.append(
                f"truncated_importance_sampling_type={tis!r} is not one of 'tis', 'icepop', 'seq-mask-tis', "
                "'seq-mis', 'geo-rs' (or null)"
            )
        if tis not in REJECTION_TYPES and not cfg.use_importance_sampling_correction:
            out.append(
                "truncated importance sampling is only supported when use_importance_sampling_correction is True: "
                "set use_importance_sampling_correction: true or truncated_importance_sampling_type: null"
            )
        if hi is None or hi <= 0:
            out.append(
                f"truncated_importance_sampling_ratio should be positive: truncated_importance_sampling_type={tis!r} "
                f"needs truncated_importance_sampling_ratio > 0 (got {hi})"
            )
        if tis in ("icepop", *SEQUENCE_MASK_TYPES) and lo is None:
            out.append(
                f"truncated_importance_sampling_ratio_min should be set when truncated_importance_sampling_type is "
                f"{tis!r}: set the lower bound of the band"
            )
        if lo is not None and hi is not None and lo > hi:
            # NeMo-RL's wording, which its tests match on
            out.append(
                "truncated_importance_sampling_ratio_min must be <= truncated_importance_sampling_ratio "
                f"(got {lo} > {hi}): swap them or lower truncated_importance_sampling_ratio_min"
            )
        if tis == "seq-mask-tis" and gspo and cfg.is_correction_level is None:
            out.append(
                "seq-mask-tis is not supported with sequence_level_importance_ratios=true unless is_correction_level "
                "is set explicitly (token or sequence_mean)"
            )
        if tis == "seq-mask-tis" and cfg.is_correction_level in ("sequence", "cumulative"):
            out.append(
                f"seq-mask-tis masks token weights by the sequence geometric mean; is_correction_level="
                f"{cfg.is_correction_level!r} is not a token-wise weight: use 'token' or 'sequence_mean'"
            )
    elif hi is not None:  # NeMo-RL refuses this at its first call ("Invalid truncated importance sampling type")
        out.append(
            "truncated_importance_sampling_ratio is set but truncated_importance_sampling_type is null: set the type "
            "('tis', 'icepop', ...) or unset truncated_importance_sampling_ratio"
        )
    elif lo is not None:  # NeMo-RL runs with it (and ignores it)
        warnings.warn(
            "truncated_importance_sampling_ratio_min is ignored: truncated_importance_sampling_type is null",
            UserWarning, stacklevel=2,
        )

    if cfg.use_cispo:
        for flag, bad in (
            ("disable_ppo_ratio", cfg.disable_ppo_ratio),
            ("force_on_policy_ratio", cfg.force_on_policy_ratio),
            ("sequence_level_importance_ratios", gspo),
        ):
            if bad:
                out.append(f"use_cispo=true is incompatible with {flag}=true; turn one of them off")
        if cfg.ratio_clip_c is not None:
            out.append("use_cispo=true is incompatible with ratio_clip_c (dual clip); set ratio_clip_c: null")
        if not cfg.token_level_loss:
            out.append("use_cispo=true requires token_level_loss=true")
        if cfg.ratio_level not in (None, "token"):
            out.append(f"use_cispo=true uses the token ratio; ratio_level={cfg.ratio_level!r} is not allowed")
        if cfg.uses_log_space_clip:
            out.append("use_cispo=true clips in ratio space; unset log_ratio_clip_low/high")

    if cfg.disable_ppo_ratio and cfg.ratio_level not in (None, "token"):
        out.append(f"disable_ppo_ratio=true has no ratio; ratio_level={cfg.ratio_level!r} must be unset")
    if cfg.force_on_policy_ratio and cfg.ratio_level not in (None, "token", "sequence"):
        out.append(f"force_on_policy_ratio=true fixes the ratio to 1; ratio_level={cfg.ratio_level!r} must be unset")

    low, high = cfg.log_ratio_clip_low, cfg.log_ratio_clip_high
    if (low is None) != (high is None):
        out.append("log_ratio_clip_low and log_ratio_clip_high must be set together (CTPO defaults: 0.025 and 0.05)")
    if cfg.uses_log_space_clip:
        if cfg.ratio_clip_c is not None:
            out.append("log-space clipping uses log_ratio_clip_c for the dual clip; set ratio_clip_c: null")
        if cfg.disable_ppo_ratio:
            out.append("log_ratio_clip_low/high need a policy ratio; disable_ppo_ratio must be false")
    elif cfg.log_ratio_clip_c is not None:
        out.append("log_ratio_clip_c needs log_ratio_clip_low and log_ratio_clip_high")
    if cfg.clip_position_power != 0.0 and not cfg.uses_log_space_clip:
        out.append("clip_position_power scales the log-space bounds; set log_ratio_clip_low/high as well")

    if cfg.loss_aggregation is not None:
        token_agg = cfg.loss_aggregation in TOKEN_AGGREGATIONS
        if "token_level_loss" in cfg.model_fields_set and token_agg != cfg.token_level_loss:
            out.append(
                f"loss_aggregation={cfg.loss_aggregation!r} contradicts token_level_loss={cfg.token_level_loss}; "
                "set only one of them"
            )
    if cfg.effective_loss_aggregation == "seq-mean-token-sum-norm" and cfg.loss_aggregation_norm is None:
        out.append("loss_aggregation='seq-mean-token-sum-norm' needs loss_aggregation_norm (e.g. max response length)")
    if cfg.loss_aggregation_norm is not None and cfg.effective_loss_aggregation != "seq-mean-token-sum-norm":
        out.append("loss_aggregation_norm is only read by loss_aggregation='seq-mean-token-sum-norm'")

    out.extend(_rejection_contradictions(cfg))
    out.extend(_rule_contradictions(cfg))
    needs_is = cfg.importance_sampling_batch_normalize or cfg.is_correction_level is not None
    rejects = tis in REJECTION_TYPES or bool(cfg.rejection_rules)
    if needs_is and not cfg.use_importance_sampling_correction and not rejects:
        which = "is_correction_level" if cfg.is_correction_level is not None else "importance_sampling_batch_normalize"
        out.append(f"{which} has no effect without use_importance_sampling_correction=true; enable it or unset {which}")
    if cfg.reference_policy_kl_gradient == "k2" and cfg.effective_kl_penalty == 0:
        out.append("reference_policy_kl_gradient='k2' needs a non-zero reference_policy_kl_penalty in the loss")
    if cfg.max_log_ratio is not None and cfg.disable_ppo_ratio:
        out.append("max_log_ratio caps the policy ratio; disable_ppo_ratio must be false")
    return out


def _rejection_contradictions(cfg: ClippedPGLossConfig) -> list[str]:
    rej = cfg.importance_sampling_rejection
    lo, hi = cfg.importance_sampling_rejection_min, cfg.importance_sampling_rejection_max
    if rej is None:
        if lo is not None or hi is not None:
            return ["importance_sampling_rejection_min and importance_sampling_rejection_max are only read with "
                    "importance_sampling_rejection, which is null: set it to 'seq-mis' or 'geo-rs', or unset them"]
        return []
    out = []
    if lo is None or hi is None:
        out.append(f"importance_sampling_rejection={rej!r} needs importance_sampling_rejection_min and "
                   "importance_sampling_rejection_max (verl presets: seq-mis 0.5 and 2.0, geo-rs 0.999 and 1.001)")
    elif lo > hi:
        out.append(f"importance_sampling_rejection_min={lo} must be <= importance_sampling_rejection_max={hi}")
    tis = cfg.truncated_importance_sampling_type
    if tis in SEQUENCE_MASK_TYPES:
        out.append(f"truncated_importance_sampling_type={tis!r} already masks whole sequences: combine "
                   "importance_sampling_rejection with 'tis', 'icepop' or null, or use a single sequence rule")
    return out


def _rule_contradictions(cfg: ClippedPGLossConfig) -> list[str]:
    out = []
    names = [rule.name for rule in cfg.rejection_rules]
    for name in sorted({n for n in names if names.count(n) > 1}):
        shorthand = " (importance_sampling_rejection is one)" if any(
            r.name == name for r in cfg.rejection_rules[:1]) and cfg.importance_sampling_rejection else ""
        out.append(f"two rejection rules on {name}{shorthand}: merge their bounds into one rule")
    if cfg.bypasses_prev and cfg.force_on_policy_ratio:
        out.append("old_policy_logprobs='generation' and force_on_policy_ratio=true both choose pi_old; keep one")
    return out


def load_loss_config(
    config: "ClippedPGLossConfig | dict[str, Any]", *, strict: Optional[bool] = None
) -> ClippedPGLossConfig:
    """Validate a NeMo-RL ``loss_fn`` mapping (or pass an existing config through).

    Raises :class:`ConfigValidationError` (a pydantic ``ValidationError``, ``ValueError`` and ``AssertionError``).
    ``strict``: unknown keys are an error (True) or a warning (False); None reads ``NEMO_IS_STRICT_CONFIG``.
    """
    if isinstance(config, ClippedPGLossConfig):
        return config
    if not isinstance(config, dict):
        try:
            config = dict(config)  # e.g. an OmegaConf DictConfig converted by the caller, or a Mapping
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"loss_fn config must be a mapping, got {type(config).__name__}") from exc
    context = None if strict is None else {"strict_keys": strict}
    return ClippedPGLossConfig.model_validate(config, context=context)
