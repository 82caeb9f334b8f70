"""Every ``loss_fn`` key, one field each: its name, type, default, allowed values, and valid range with why and fix.

To change a key, edit its field here: the validation (type, choices, range), the error messages and the JSON schema
follow from it (the range table of docs/config.md is checked against it by tests/config/test_config_ranges.py).
:class:`~nemo_is_plugin.config.model.ClippedPGLossConfig` adds the combination checks and the derived choices.
Imports without torch.
"""

from __future__ import annotations

from typing import Annotated, Literal, get_args

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
PolicyObjective = Literal["ppo_clip", "dppo_tv", "dppo_kl", "prob_diff", "cppo", "sapo", "gmpo", "gpg", "dro"]

# Objectives whose per-token loss reads the token ratio r_t = exp(c_t - a_t) (a trust mask or a gate on it).
TOKEN_RATIO_OBJECTIVES: tuple[str, ...] = ("dppo_tv", "dppo_kl", "prob_diff", "cppo", "sapo")
# The objectives besides PPO's clip (docs/objectives.md): each replaces the ratio clip and its dual clip.
OTHER_OBJECTIVES: tuple[str, ...] = get_args(PolicyObjective)[1:]

# Aggregations without a per-sequence normalisation: NeMo-RL's token_level_loss=true.
TOKEN_AGGREGATIONS: tuple[str, ...] = ("token-mean", "token-sum")
# Truncation types that reject whole sequences instead of reweighting tokens; they may run without IS weights.
REJECTION_TYPES: tuple[str, ...] = get_args(RejectionType)
# Truncation types that mask whole sequences by a sequence statistic.
SEQUENCE_MASK_TYPES: tuple[str, ...] = ("seq-mask-tis", *REJECTION_TYPES)

# The ranges: null (where allowed) always means "off". w = 1 is the weight of an on-policy token, so every band on an
# IS weight must contain 1: a band without it acts on data with no mismatch at all.


class LossKeys(BaseModel):
    """The keys of :class:`~nemo_is_plugin.config.ClippedPGLossConfig`, without its checks and derived choices.

    The first block is NeMo-RL's ``ClippedPGLossConfig`` (commit 7ea279ab): names, types and defaults unchanged, so an
    existing NeMo-RL ``loss_fn`` section validates unchanged. The second block holds the plugin's independent choices
    (``None`` / off reproduces NeMo-RL); see ``docs/config.md`` for each formula.
    """

    # No extra="forbid": unknown keys never reach pydantic (ClippedPGLossConfig warns about or refuses them first).
    model_config = ConfigDict(validate_assignment=True, allow_inf_nan=False)

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
    log_ratio_clip_low: Annotated[
        float | None,
        NumericRange(
            low=0.0,
            low_open=True,
            why="the log-space band is [-eps_low * t^p, eps_high * t^p]; eps <= 0 excludes log r = 0",
            fix="use e.g. 0.025 (CTPO) or leave both log_ratio_clip keys null",
        ),
    ] = Field(None, description="eps_low of the log-space clip: log r >= -eps_low * t^clip_position_power.")
    log_ratio_clip_high: Annotated[
        float | None,
        NumericRange(
            low=0.0,
            low_open=True,
            why="the log-space band is [-eps_low * t^p, eps_high * t^p]; eps <= 0 excludes log r = 0",
            fix="use e.g. 0.05 (CTPO) or leave both log_ratio_clip keys null",
        ),
    ] = Field(None, description="eps_high of the log-space clip: log r <= eps_high * t^clip_position_power.")
    log_ratio_clip_c: Annotated[
        float | None,
        NumericRange(
            low=0.0,
            low_open=True,
            why="the log-space dual clip caps the loss of A < 0 at -A * exp(eps_c * t^p), which must lie above 1",
            fix="use e.g. 0.05 (CTPO) or null",
        ),
    ] = Field(None, description="Log-space dual clip: for A < 0 the loss is capped at -A * exp(eps_c * t^power).")
    clip_position_power: Annotated[
        float,
        NumericRange(
            low=-1.0,
            high=1.0,
            why="a cumulative log-ratio grows at most linearly in the position t, so bounds eps * t^p with p > 1 "
            "outgrow every reachable log-ratio (the clip silently turns off) and p < -1 shrink faster than 1/t (every "
            "late token is clipped)",
            fix="use 0 (fixed bounds) or 0.5 (CTPO)",
        ),
    ] = Field(0.0, description="p in the position-adaptive bounds eps * t^p (CTPO uses 0.5); 0 gives fixed bounds.")
    token_log_ratio_clamp: Annotated[
        float | None,
        NumericRange(
            low=0.0,
            low_open=True,
            why="each token log-ratio is clamped to [-v, v]; v <= 0 forces every ratio to 1",
            fix="use e.g. 20 (CTPO, verl) or null",
        ),
    ] = Field(None, description="Clamp each token log-ratio c_t - p_t to +-value before building the ratio (CTPO: 20).")
    max_log_ratio: Annotated[
        float | None,
        NumericRange(
            low=0.0,
            low_open=True,
            why="log r is capped at this value with zero gradient beyond; a cap <= 0 freezes every token whose "
            "ratio exceeds 1",
            fix="use e.g. 10 (CTPO) or null",
        ),
    ] = Field(None, description="Upper cap on the log of the policy ratio after building it (CTPO: 10).")
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

    # ---- the policy objective (docs/objectives.md); each key below is read by the objectives it names ----
    policy_objective: PolicyObjective = Field(
        "ppo_clip",
        description="The per-token surrogate and its trust region: 'ppo_clip' (the ratio clip above; NeMo-RL's), "
        "'dppo_tv' / 'dppo_kl' (DPPO binary TV / KL masks), 'prob_diff' (prime-rl's |p - q| mask), 'cppo' "
        "(position-weighted TV mask with a prefix budget), 'sapo' (soft gate), 'gmpo' (geometric-mean sequence "
        "ratio), 'gpg' (-A log pi), 'dro' (-(A log pi - beta/2 (log r)^2)). The anchor q is pi_old.",
    )
    dppo_delta_low: Annotated[
        float | None,
        NumericRange(
            low=0.0,
            low_open=True,
            why="the DPPO threshold on the divergence of a token with A <= 0 (TV: q - p, KL: the binary KL); 0 or "
            "less drops every token that moved at all",
            fix="use e.g. 0.2 (verl's clip_ratio_low under loss_mode dppo_tv)",
        ),
    ] = Field(None, description="DPPO threshold for A <= 0 (dppo_tv / dppo_kl; required there).")
    dppo_delta_high: Annotated[
        float | None,
        NumericRange(
            low=0.0,
            low_open=True,
            why="the DPPO threshold on the divergence of a token with A > 0 (TV: p - q, KL: the binary KL); 0 or "
            "less drops every token that moved at all",
            fix="use e.g. 0.28 (verl's clip_ratio_high under loss_mode dppo_tv)",
        ),
    ] = Field(None, description="DPPO threshold for A > 0 (dppo_tv / dppo_kl; required there).")
    dppo_ratio_cap: Annotated[
        float,
        NumericRange(
            low=1.0,
            why="DPPO's gradient weight is min(r, cap) on kept tokens; a cap below 1 also shrinks the weight of "
            "unchanged tokens (r = 1), a learning-rate cut rather than a cap",
            fix="use 20 (DPPO; verl's dict default) or 3 (verl's ActorConfig clip_ratio_c)",
        ),
    ] = Field(20.0, description="Cap C of DPPO's detached ratio weight min(r, C) (verl: clip_ratio_c).")
    prob_diff_threshold: Annotated[
        float,
        NumericRange(
            low=0.0,
            high=1.0,
            low_open=True,
            why="a token is kept while |p - q| <= threshold; probabilities differ by at most 1, so a threshold "
            "above 1 keeps everything and one <= 0 drops every token that moved",
            fix="use 0.1 (prime-rl's ipo_threshold)",
        ),
    ] = Field(0.1, description="prob_diff: keep a token while |p - q| <= this.")
    cppo_delta: Annotated[
        float,
        NumericRange(
            low=0.0,
            high=1.0,
            low_open=True,
            why="CPPO's per-token TV threshold on w_k |p - q| <= 1; 0 or less drops every token that moved",
            fix="use 0.2 (UniRL)",
        ),
    ] = Field(0.2, description="CPPO per-token TV threshold delta.")
    cppo_w_min: Annotated[
        float,
        NumericRange(
            low=0.0,
            high=1.0,
            low_open=True,
            why="the last position's weight: weights fall linearly from 1 to w_min; 0 exempts the last token, "
            "above 1 the weights grow",
            fix="use 0.8 (UniRL), or 1 for uniform weights",
        ),
    ] = Field(0.8, description="CPPO weight of a sequence's last position (the first has 1).")
    cppo_delta_b: Annotated[
        float,
        NumericRange(
            low=0.0,
            why="the floor of the per-sequence budget rate b = clamp(quantile_0.9(D), delta_b, 2 delta_b); "
            "a negative rate exhausts the budget at the first token",
            fix="use 0.02 (UniRL)",
        ),
    ] = Field(0.02, description="CPPO budget rate floor (the ceiling is twice it).")
    sapo_tau_pos: Annotated[
        float,
        NumericRange(
            low=0.0,
            low_open=True,
            why="the gate sigmoid(tau (r - 1)) 4 / tau divides by tau",
            fix="use 1.0 (verl's tau_pos)",
        ),
    ] = Field(1.0, description="SAPO gate temperature for A > 0.")
    sapo_tau_neg: Annotated[
        float,
        NumericRange(
            low=0.0,
            low_open=True,
            why="the gate sigmoid(tau (r - 1)) 4 / tau divides by tau",
            fix="use 1.05 (verl's tau_neg)",
        ),
    ] = Field(1.05, description="SAPO gate temperature for A <= 0.")
    gmpo_clip_low: Annotated[
        float | None,
        NumericRange(
            low=0.0,
            low_open=True,
            why="GMPO clips the token log-ratio of A < 0 tokens at -eps; eps <= 0 excludes log r = 0",
            fix="use e.g. 0.4 (GMPO's (e^-0.4, e^0.4)) or verl's clip_ratio_low",
        ),
    ] = Field(None, description="GMPO lower log-ratio clip eps_low (gmpo; required there).")
    gmpo_clip_high: Annotated[
        float | None,
        NumericRange(
            low=0.0,
            low_open=True,
            why="GMPO clips the token log-ratio of A > 0 tokens at eps; eps <= 0 excludes log r = 0",
            fix="use e.g. 0.4 (GMPO's (e^-0.4, e^0.4)) or verl's clip_ratio_high",
        ),
    ] = Field(None, description="GMPO upper log-ratio clip eps_high (gmpo; required there).")
    dro_beta: Annotated[
        float | None,
        NumericRange(
            low=0.0,
            low_open=True,
            why="DRO's penalty beta/2 (log r)^2 must pull the policy back to the anchor; beta <= 0 pushes it away",
            fix="use a positive value (verl's policy_loss.dro_beta)",
        ),
    ] = Field(None, description="DRO quadratic-penalty weight beta (dro; required there).")

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


# Every numeric key's interval, read from its field (the docs' range table and the tests compare against it).
NUMERIC_RANGES: dict[str, NumericRange] = {
    key: meta for key, info in LossKeys.model_fields.items() for meta in info.metadata if isinstance(meta, NumericRange)
}
