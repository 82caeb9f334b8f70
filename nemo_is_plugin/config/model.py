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
    sequence_mean    w_i = exp(sum_t m_t (p_t - g_t) / sum_t m_t)          (NeMo-RL PR #2269, geometric mean)
    cumulative       w_it = exp(sum_{j<=t} m_j (p_j - g_j))                 (prefix correction; no framework has it)
- log-space clip (CTPO), when log_ratio_clip_low/high are set:
    clipped ratio = exp(clamp(log r, -eps_low * t^power, eps_high * t^power)); dual clip c_t = exp(eps_c * t^power).
- rejection rules (verl's rollout_rs): keep a token / sequence while min <= agg_t k(y_t) <= max, y = clamp(p - g, +-20),
    k1 = -y, k2 = y^2 / 2, k3 = e^y - 1 - y, agg = per token | sequence sum | mean | max (RejectionRule).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from nemo_is_plugin.config.choices import (
    TOKEN_AGGREGATIONS,
    ISCorrectionLevel,
    KLGradient,
    LossAggregation,
    OldPolicyLogprobs,
    RatioLevel,
    RejectionType,
)
from nemo_is_plugin.config.contradictions import contradictions
from nemo_is_plugin.config.errors import ConfigError, ConfigValidationError
from nemo_is_plugin.config.ranges import range_errors
from nemo_is_plugin.config.rejection_rule import RejectionRule
from nemo_is_plugin.config.unknown_keys import STRICT_KEYS_OVERRIDE, check_unknown_keys, strict_keys_default


class ClippedPGLossConfig(BaseModel):
    """Configuration of :class:`nemo_is_plugin.loss.ClippedPGLoss`.

    The first block is NeMo-RL's ``ClippedPGLossConfig`` (commit 7ea279ab), unchanged. The second block holds the
    plugin's independent choices; see ``docs/config.md`` for each formula.
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    # ---- NeMo-RL keys (names, types and defaults as in NeMo-RL) ----
    reference_policy_kl_penalty: float = 0.01
    reference_policy_kl_type: str = "k3"
    kl_input_clamp_value: float | None = 20.0
    kl_output_clamp_value: float | None = 10.0
    ratio_clip_min: float = 0.2
    ratio_clip_max: float = 0.2
    ratio_clip_c: float | None = None
    use_on_policy_kl_approximation: bool = False
    use_importance_sampling_correction: bool = False
    truncated_importance_sampling_type: str | None = None
    truncated_importance_sampling_ratio: float | None = None
    truncated_importance_sampling_ratio_min: float | None = None
    token_level_loss: bool = True
    sequence_level_importance_ratios: bool = False
    force_on_policy_ratio: bool = False
    use_kl_in_reward: bool = False
    disable_ppo_ratio: bool = False
    use_cispo: bool = False
    positive_example_nll_weight: float = 0.0

    # ---- plugin choices (None / off reproduces NeMo-RL) ----
    ratio_level: RatioLevel | None = Field(
        None, description="Policy-ratio level; None derives it from sequence_level_importance_ratios like NeMo-RL."
    )
    is_correction_level: ISCorrectionLevel | None = Field(
        None, description="IS-weight level; None derives it from sequence_level_importance_ratios like NeMo-RL."
    )
    log_ratio_clip_low: float | None = Field(
        None, description="eps_low of the log-space clip: log r >= -eps_low * t^clip_position_power."
    )
    log_ratio_clip_high: float | None = Field(
        None, description="eps_high of the log-space clip: log r <= eps_high * t^clip_position_power."
    )
    log_ratio_clip_c: float | None = Field(
        None, description="Log-space dual clip: for A < 0 the loss is capped at -A * exp(eps_c * t^power)."
    )
    clip_position_power: float = Field(
        0.0, description="p in the position-adaptive bounds eps * t^p (CTPO uses 0.5); 0 gives fixed bounds."
    )
    token_log_ratio_clamp: float | None = Field(
        None, description="Clamp each token log-ratio c_t - p_t to +-value before building the ratio (CTPO: 20)."
    )
    max_log_ratio: float | None = Field(
        None, description="Upper cap on the log of the policy ratio after building it (CTPO: 10)."
    )
    importance_sampling_rejection: RejectionType | None = Field(
        None,
        description="Sequence rejection on top of the truncation type: 'seq-mis' (exp(sum_t x_t)) or 'geo-rs' "
        "(exp(mean_t x_t)) outside [importance_sampling_rejection_min, _max] zeroes the sequence (verl's "
        "Seq-MIS / Geo-RS + TIS presets).",
    )
    importance_sampling_rejection_min: float | None = Field(
        None, description="Lower bound of the rejection band (ratio space)."
    )
    importance_sampling_rejection_max: float | None = Field(
        None, description="Upper bound of the rejection band (ratio space)."
    )
    importance_sampling_veto_threshold: float | None = Field(
        None, description="Reject a sequence if any token weight exp(p_t - g_t) is below this (veto)."
    )
    importance_sampling_batch_normalize: bool = Field(
        False, description="Divide IS weights by their masked mean over the batch (after truncation)."
    )
    reference_policy_kl_gradient: KLGradient = Field(
        "estimator", description="'k2': straight-through KL whose value is the chosen estimator and gradient is k2's."
    )
    loss_aggregation: LossAggregation | None = Field(
        None, description="Loss aggregation; None derives it from token_level_loss like NeMo-RL."
    )
    loss_aggregation_norm: float | None = Field(
        None, description="Constant divisor per sequence for seq-mean-token-sum-norm (e.g. max response length)."
    )

    # ---- rejection rules and the old policy (verl's rollout_rs / bypass_mode in the plugin's vocabulary) ----
    importance_sampling_rejection_rules: list[RejectionRule] = Field(
        default_factory=list,
        description="Rejection criteria that must all pass (verl's rollout_rs): a token or "
        "sequence failing one gets weight 0, after truncation and batch normalisation. See RejectionRule.",
    )
    old_policy_logprobs: OldPolicyLogprobs = Field(
        "prev",
        description="pi_old of the policy ratio: 'prev' (three policies) or 'generation' (verl's bypass_mode: "
        "r = pi_theta / mu, and the IS weights / rejections measure the current policy, detached, against mu).",
    )
    strict_input_checks: bool = Field(
        False,
        description="Raise on non-finite generation log-probs and on positive log-probs (above the dtype's "
        "rounding tolerance) instead of computing them as NeMo-RL does and reporting them in the input_* metrics.",
    )

    # ------------------------------------------------------------------ construction: one exception type
    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise ConfigValidationError.wrap(exc) from None

    @classmethod
    def model_validate(cls, obj: Any, **kwargs: Any) -> ClippedPGLossConfig:
        """pydantic's ``model_validate``; ``context={"strict_keys": True}`` makes unknown keys an error."""
        token = STRICT_KEYS_OVERRIDE.set((kwargs.get("context") or {}).get("strict_keys"))
        try:
            return super().model_validate(obj, **kwargs)
        except ValidationError as exc:
            raise ConfigValidationError.wrap(exc) from None
        finally:
            STRICT_KEYS_OVERRIDE.reset(token)

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
                strict = STRICT_KEYS_OVERRIDE.get()
                check_unknown_keys(unknown, known, strict=strict_keys_default() if strict is None else bool(strict))
                data = {k: v for k, v in data.items() if k in known}
        return data

    @model_validator(mode="after")
    def _check_combinations(self) -> ClippedPGLossConfig:
        # token_level_loss follows an explicit loss_aggregation unless the user set both (then they must agree), so
        # that a model_dump() reloads unchanged.
        if self.loss_aggregation is not None and "token_level_loss" not in self.model_fields_set:
            self.__dict__["token_level_loss"] = self.loss_aggregation in TOKEN_AGGREGATIONS
        # Out-of-range values first and alone: the combination checks below compare values that must be in range.
        errors = range_errors(self) or [msg for msg in contradictions(self) if msg]
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
    def log_ratio_clip_bounds(self) -> tuple[float, float]:
        """(eps_low, eps_high) of the log-space clip; read when :attr:`uses_log_space_clip` (validation sets both)."""
        low, high = self.log_ratio_clip_low, self.log_ratio_clip_high
        if low is None or high is None:
            raise ConfigError("log_ratio_clip_low and log_ratio_clip_high must be set together (CTPO: 0.025 and 0.05)")
        return low, high

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


def load_loss_config(
    config: ClippedPGLossConfig | dict[str, Any], *, strict: bool | None = None
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
