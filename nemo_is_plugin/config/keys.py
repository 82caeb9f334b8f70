"""Every generic ``loss_fn`` key, one field each: its name, type, default, allowed values, valid range with why and fix.

To change a key, edit its field here: the validation (type, choices, range), the error messages and the JSON schema
follow from it (the range table of docs/config.md is checked against it by tests/config/test_config_ranges.py). The
keys of one policy objective live with its formula, in its module (``nemo_is_plugin/loss/objectives/<name>.py``), as a
:class:`KeySection`; :class:`~nemo_is_plugin.ClippedPGLossConfig` is these keys plus every registered
objective's section, with the combination checks and the derived choices. Imports without torch.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeVar, get_args

from pydantic import BaseModel, ConfigDict, Field

from nemo_is_plugin.config.field_types import KLType, NumericRange
from nemo_is_plugin.config.rejection_rule import RejectionRule

# ---- the values of each choice key (typing.get_args gives them as a tuple) and the groups the checks use ----
RatioLevel = Literal["token", "sequence", "sequence_token", "cumulative", "cumulative_mean"]
ISCorrectionLevel = Literal["token", "sequence", "sequence_mean", "cumulative"]
TruncationType = Literal["tis", "icepop", "seq-mask-tis", "seq-mis", "geo-rs"]
RejectionType = Literal["seq-mis", "geo-rs"]
KLGradient = Literal["estimator", "k2"]
LossAggregation = Literal[
    "token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"
]
OldPolicyLogprobs = Literal["prev", "generation"]

# Aggregations without a per-sequence normalisation: NeMo-RL's token_level_loss=true.
TOKEN_AGGREGATIONS: tuple[str, ...] = ("token-mean", "token-sum")
# Truncation types that reject whole sequences instead of reweighting tokens; they may run without IS weights.
REJECTION_TYPES: tuple[str, ...] = get_args(RejectionType)
# Truncation types that mask whole sequences by a sequence statistic.
SEQUENCE_MASK_TYPES: tuple[str, ...] = ("seq-mask-tis", *REJECTION_TYPES)

# The ranges: null (where allowed) always means "off". w = 1 is the weight of an on-policy token, so every band on an
# IS weight must contain 1: a band without it acts on data with no mismatch at all.
MODEL_CONFIG = ConfigDict(validate_assignment=True, allow_inf_nan=False)
_Section = TypeVar("_Section", bound="KeySection")


class KeySection(BaseModel):
    """The keys one policy objective reads (its fields), declared in the objective's module; ``ClippedPGLossConfig``
    inherits every registered section, so the keys stay flat in a ``loss_fn`` section (``dppo_delta_low: 0.2``).

    A key set away from its default while another objective is chosen is refused (:meth:`unread`)."""

    model_config = MODEL_CONFIG

    @classmethod
    def of(cls: type[_Section], cfg: Any) -> _Section:
        """``cfg`` (a ``ClippedPGLossConfig``, which inherits every section) typed as this section."""
        if not isinstance(cfg, cls):
            raise TypeError(f"{type(cfg).__name__} does not hold the keys of {cls.__name__}")
        return cfg

    @classmethod
    def own_keys(cls) -> tuple[str, ...]:
        """This section's keys (the fields it declares, not those of ``KeySection``)."""
        return tuple(k for k in cls.model_fields if k not in KeySection.model_fields)

    @classmethod
    def unread(cls, cfg: Any, readers: list[str], chosen: str) -> list[str]:
        """The refusal of each of this section's keys set away from its default while ``chosen`` (none of
        ``readers``) is the configured ``policy_objective``."""
        return [
            f"{key} is read by policy_objective {' / '.join(readers)} only, not {chosen!r}: unset it"
            for key in cls.own_keys()
            if getattr(cfg, key) != cls.model_fields[key].default
        ]


class LossKeys(BaseModel):
    """The generic keys of :class:`~nemo_is_plugin.ClippedPGLossConfig` and the choices derived from them
    (``effective_*``, ``rejection_rules``, ``bypasses_prev``), without its checks (each policy objective's own keys are
    its :class:`KeySection`).

    The first block is NeMo-RL's ``ClippedPGLossConfig`` (commit 7ea279ab): names, types and defaults unchanged, so an
    existing NeMo-RL ``loss_fn`` section validates unchanged. The second block holds the plugin's independent choices
    (``None`` / off reproduces NeMo-RL); see ``docs/config.md`` for each formula.
    """

    # No extra="forbid": unknown keys never reach pydantic (ClippedPGLossConfig warns about or refuses them first).
    model_config = MODEL_CONFIG

    # ---- NeMo-RL keys (names, types and defaults as in NeMo-RL) ----
    reference_policy_kl_penalty: Annotated[
        float,
        NumericRange(
            low=0.0,
            why="beta weights a penalty; a negative beta rewards moving away from the reference policy",
            fix="use 0 to turn the KL term off",
        ),
    ] = 0.01
    reference_policy_kl_type: KLType = "k3"
    kl_input_clamp_value: Annotated[
        float | None,
        NumericRange(
            low=0.0,
            low_open=True,
            why="log(pi_ref / pi) is clamped to [-v, v]; v <= 0 makes that interval empty or a single point",
            fix="use a positive value (NeMo-RL: 20) or null for no clamp",
        ),
    ] = 20.0
    kl_output_clamp_value: Annotated[
        float | None,
        NumericRange(
            low=0.0,
            low_open=True,
            why="the per-token KL is clamped to [-v, v]; v <= 0 makes that interval empty or a single point",
            fix="use a positive value (NeMo-RL: 10) or null for no clamp",
        ),
    ] = 10.0
    ratio_clip_min: Annotated[
        float,
        NumericRange(
            low=0.0,
            high=1.0,
            why="the PPO band's lower edge 1 - ratio_clip_min must lie in [0, 1]: a negative value puts it above 1 (an "
            "inverted band without ratio 1), a value above 1 puts it below 0, where no ratio lies",
            fix="use e.g. 0.2, or 1.0 for no lower clip (NeMo-RL's CISPO recipe)",
        ),
    ] = 0.2
    ratio_clip_max: Annotated[
        float,
        NumericRange(
            low=0.0,
            why="the PPO band's upper edge 1 + ratio_clip_max must be >= 1: a negative value excludes ratio 1",
            fix="use e.g. 0.2 or 0.28 (DAPO's clip-higher)",
        ),
    ] = 0.2
    ratio_clip_c: Annotated[
        float | None,
        NumericRange(
            low=1.0,
            low_open=True,
            why="the dual clip caps the loss of A < 0 at -A * c, which must lie above the clipped ratio's 1",
            fix="use e.g. 3.0, or null to disable dual clipping",
        ),
    ] = None
    use_on_policy_kl_approximation: bool = False
    use_importance_sampling_correction: bool = False
    truncated_importance_sampling_type: TruncationType | None = None
    truncated_importance_sampling_ratio: Annotated[
        float | None,
        NumericRange(
            low=0.0,
            low_open=True,
            # starts with NeMo-RL's wording, which its tests match on
            why="truncated_importance_sampling_ratio should be positive: it is the upper bound of the IS weight (a "
            "bound below 1 also truncates on-policy tokens, w = 1: a deliberate learning-rate cut that NeMo-RL's own "
            "tests use, so it is allowed)",
            fix="use e.g. 2.0 (tis) or 5.0 (icepop)",
        ),
    ] = None
    truncated_importance_sampling_ratio_min: Annotated[
        float | None,
        NumericRange(
            low=0.0,
            why="the lower bound of the IS weight (0 = none); that it does not exceed "
            "truncated_importance_sampling_ratio is checked with it, in NeMo-RL's words",
            fix="use e.g. 0.5 (icepop), 0.999 (seq-mask-tis / geo-rs) or null",
        ),
    ] = None
    token_level_loss: bool = True
    sequence_level_importance_ratios: bool = False
    force_on_policy_ratio: bool = False
    use_kl_in_reward: bool = False
    disable_ppo_ratio: bool = False
    use_cispo: bool = False
    positive_example_nll_weight: Annotated[
        float,
        NumericRange(
            low=0.0,
            why="the weight of the NLL of rewarded samples; NeMo-RL silently drops the term for a weight <= 0, so a "
            "negative weight is a typo (it would push their probability down if applied)",
            fix="use 0 to turn it off",
        ),
    ] = 0.0

    # ---- plugin choices (None / off reproduces NeMo-RL) ----
    ratio_level: RatioLevel | None = Field(
        None, description="Policy-ratio level; None derives it from sequence_level_importance_ratios like NeMo-RL."
    )
    is_correction_level: ISCorrectionLevel | None = Field(
        None, description="IS-weight level; None derives it from sequence_level_importance_ratios like NeMo-RL."
    )
    token_log_ratio_clamp: Annotated[
        float | None,
        NumericRange(
            low=0.0,
            low_open=True,
            why="each token log-ratio is clamped to [-v, v]; v <= 0 forces every ratio to 1",
            fix="use e.g. 20 (CTPO, verl) or null",
        ),
    ] = Field(None, description="Clamp each token log-ratio c_t - p_t to +-value before building the ratio (CTPO: 20).")
    importance_sampling_rejection: RejectionType | None = Field(
        None,
        description="Sequence rejection on top of the truncation type: 'seq-mis' (exp(sum_t x_t)) or 'geo-rs' "
        "(exp(mean_t x_t)) outside [importance_sampling_rejection_min, _max] zeroes the sequence (verl's "
        "Seq-MIS / Geo-RS + TIS presets).",
    )
    importance_sampling_rejection_min: Annotated[
        float | None,
        NumericRange(
            low=0.0,
            high=1.0,
            low_open=True,
            why="the rejection band is tested in log space and must contain the on-policy weight 1",
            fix="use e.g. 0.5 (seq-mis) or 0.999 (geo-rs)",
        ),
    ] = Field(None, description="Lower bound of the rejection band (ratio space).")
    importance_sampling_rejection_max: Annotated[
        float | None,
        NumericRange(
            low=1.0,
            why="the rejection band must contain the on-policy weight 1",
            fix="use e.g. 2.0 (seq-mis) or 1.001 (geo-rs)",
        ),
    ] = Field(None, description="Upper bound of the rejection band (ratio space).")
    importance_sampling_veto_threshold: Annotated[
        float | None,
        NumericRange(
            low=0.0,
            high=1.0,
            low_open=True,
            high_open=True,
            why="a sequence is vetoed if a token weight falls below the threshold; at 1 or above on-policy tokens "
            "(w = 1) veto their sequence",
            fix="use e.g. 1e-4, or null",
        ),
    ] = Field(None, description="Reject a sequence if any token weight exp(p_t - g_t) is below this (veto).")
    importance_sampling_batch_normalize: bool = Field(
        False, description="Divide IS weights by their masked mean over the batch (after truncation)."
    )
    reference_policy_kl_gradient: KLGradient = Field(
        "estimator", description="'k2': straight-through KL whose value is the chosen estimator and gradient is k2's."
    )
    loss_aggregation: LossAggregation | None = Field(
        None, description="Loss aggregation; None derives it from token_level_loss like NeMo-RL."
    )
    loss_aggregation_norm: Annotated[
        float | None,
        NumericRange(
            low=0.0,
            low_open=True,
            why="the per-sequence divisor of seq-mean-token-sum-norm",
            fix="use the maximum response length",
        ),
    ] = Field(None, description="Constant divisor per sequence for seq-mean-token-sum-norm (e.g. max response length).")

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
    # ---- score centering (arXiv 2609.20807; verl's algorithm.rollout_correction.score_centering) ----
    score_centering: bool = Field(
        False,
        description="Add the score-centering term +sg(A) sum_{v in H} sg(c_v) log p_v over the sampler's top-k head H "
        "(c_v = q_v f(p_v/q_v) - alpha p_v, the tail modelled as rho p): it subtracts the sampler-expected weighted "
        "score, cancelling the drift E_q[A] E_q[grad log p] of a mismatched sampler. f follows from the IS "
        "truncation (docs/config.md, Score centering). Needs rollout_topk_ids / rollout_topk_logprobs in the batch.",
    )
    score_centering_top_k: Annotated[
        int | None,
        NumericRange(
            low=1,
            why="k is the number of sampler top-k log-probs recorded per token (the head H); the head needs one",
            fix="use the rollout engine's top-k log-prob count (e.g. 32 or 128), or null to take k from the data",
        ),
    ] = Field(None, description="k, the sampler head size; the batch's [*, k] head tensors are checked against it.")
    score_centering_tail_floor: Annotated[
        float,
        NumericRange(
            low=0.0,
            high=1.0,
            low_open=True,
            high_open=True,
            why="rho = max(1 - Q_H, eps) / max(1 - P_H, eps) divides tail masses; eps <= 0 lets a head covering the "
            "whole vocabulary divide by 0, eps >= 1 makes rho = 1 always (no tail model)",
            fix="use 1e-6 (the paper, verl, SkyRL, vime)",
        ),
    ] = Field(1e-6, description="eps, the floor of both tail masses 1 - Q_H and 1 - P_H in rho.")

    strict_input_checks: bool = Field(
        False,
        description="Raise on non-finite generation log-probs and on positive log-probs (above the dtype's "
        "rounding tolerance) instead of computing them as NeMo-RL does and reporting them in the input_* metrics.",
    )

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
