"""The combination checks of a loss config: every contradiction NeMo-RL rejects, plus the plugin's own.

Each message names the fields and the fix. Run by :class:`~nemo_is_plugin.config.model.ClippedPGLossConfig` once
every field is valid (types, choices and numeric ranges are the fields' own, in :mod:`~nemo_is_plugin.config.keys`).
Imports without torch.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

from nemo_is_plugin.config.keys import (
    OTHER_OBJECTIVES,
    REJECTION_TYPES,
    SEQUENCE_MASK_TYPES,
    TOKEN_AGGREGATIONS,
    TOKEN_RATIO_OBJECTIVES,
    LossKeys,
)

if TYPE_CHECKING:
    from nemo_is_plugin.config.model import ClippedPGLossConfig


def contradictions(cfg: ClippedPGLossConfig) -> list[str]:
    """Every contradiction NeMo-RL rejects, plus the plugin's own; each message names the fields and the fix."""
    out: list[str] = []
    tis = cfg.truncated_importance_sampling_type
    lo, hi = cfg.truncated_importance_sampling_ratio_min, cfg.truncated_importance_sampling_ratio
    gspo = cfg.sequence_level_importance_ratios

    if gspo and cfg.token_level_loss:
        out.append(
            "sequence-level importance sampling (e.g. GSPO) is mutually exclusive with token-level loss: "
            "sequence_level_importance_ratios=true requires token_level_loss: false"
        )
    if tis is not None:
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
            UserWarning,
            stacklevel=2,
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
    out.extend(_objective_contradictions(cfg))
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
            return [
                "importance_sampling_rejection_min and importance_sampling_rejection_max are only read with "
                "importance_sampling_rejection, which is null: set it to 'seq-mis' or 'geo-rs', or unset them"
            ]
        return []
    out = []
    if lo is None or hi is None:
        out.append(
            f"importance_sampling_rejection={rej!r} needs importance_sampling_rejection_min and "
            "importance_sampling_rejection_max (verl presets: seq-mis 0.5 and 2.0, geo-rs 0.999 and 1.001)"
        )
    elif lo > hi:
        out.append(f"importance_sampling_rejection_min={lo} must be <= importance_sampling_rejection_max={hi}")
    tis = cfg.truncated_importance_sampling_type
    if tis in SEQUENCE_MASK_TYPES:
        out.append(
            f"truncated_importance_sampling_type={tis!r} already masks whole sequences: combine "
            "importance_sampling_rejection with 'tis', 'icepop' or null, or use a single sequence rule"
        )
    return out


def _rule_contradictions(cfg: ClippedPGLossConfig) -> list[str]:
    out = []
    names = [rule.name for rule in cfg.rejection_rules]
    for name in sorted({n for n in names if names.count(n) > 1}):
        shorthand = (
            " (importance_sampling_rejection is one)"
            if any(r.name == name for r in cfg.rejection_rules[:1]) and cfg.importance_sampling_rejection
            else ""
        )
        out.append(f"two rejection rules on {name}{shorthand}: merge their bounds into one rule")
    if cfg.bypasses_prev and cfg.force_on_policy_ratio:
        out.append("old_policy_logprobs='generation' and force_on_policy_ratio=true both choose pi_old; keep one")
    return out


# Each objective's own keys (docs/objectives.md); a key set away from its default for another objective is unread.
OBJECTIVE_KEYS: dict[str, tuple[str, ...]] = {
    "dppo_delta_low": ("dppo_tv", "dppo_kl"),
    "dppo_delta_high": ("dppo_tv", "dppo_kl"),
    "dppo_ratio_cap": ("dppo_tv", "dppo_kl"),
    "prob_diff_threshold": ("prob_diff",),
    "cppo_delta": ("cppo",),
    "cppo_w_min": ("cppo",),
    "cppo_delta_b": ("cppo",),
    "sapo_tau_pos": ("sapo",),
    "sapo_tau_neg": ("sapo",),
    "gmpo_clip_low": ("gmpo",),
    "gmpo_clip_high": ("gmpo",),
    "dro_beta": ("dro",),
}
REQUIRED_OBJECTIVE_KEYS: dict[str, tuple[str, ...]] = {
    "dppo_tv": ("dppo_delta_low", "dppo_delta_high"),
    "dppo_kl": ("dppo_delta_low", "dppo_delta_high"),
    "gmpo": ("gmpo_clip_low", "gmpo_clip_high"),
    "dro": ("dro_beta",),
}
# PPO's clip keys, which every other objective replaces by its own trust region or gate.
PPO_CLIP_KEYS = (
    "ratio_clip_min",
    "ratio_clip_max",
    "ratio_clip_c",
    "log_ratio_clip_low",
    "log_ratio_clip_high",
    "log_ratio_clip_c",
    "clip_position_power",
    "max_log_ratio",
)
# Switches that choose another ratio than the objective's own.
RATIO_SWITCHES = ("use_cispo", "disable_ppo_ratio", "force_on_policy_ratio", "sequence_level_importance_ratios")


def _objective_contradictions(cfg: ClippedPGLossConfig) -> list[str]:
    out = []
    objective = cfg.policy_objective
    defaults = LossKeys.model_fields
    for key, readers in OBJECTIVE_KEYS.items():
        if objective not in readers and getattr(cfg, key) != defaults[key].default:
            out.append(f"{key} is read by policy_objective {' / '.join(readers)} only, not {objective!r}: unset it")
    if objective not in OTHER_OBJECTIVES:
        return out
    for key in REQUIRED_OBJECTIVE_KEYS.get(objective, ()):
        if getattr(cfg, key) is None:
            out.append(f"policy_objective={objective!r} needs {key} (see docs/objectives.md)")
    for key in PPO_CLIP_KEYS:
        if getattr(cfg, key) != defaults[key].default:
            out.append(
                f"{key} configures PPO's ratio clip, which policy_objective={objective!r} replaces with its own trust "
                f"region: unset {key} (or use policy_objective: ppo_clip)"
            )
    for key in RATIO_SWITCHES:
        if getattr(cfg, key):
            out.append(f"{key}=true chooses another policy ratio than policy_objective={objective!r}'s: set it false")
    if cfg.ratio_level is not None and (objective not in TOKEN_RATIO_OBJECTIVES or cfg.ratio_level != "token"):
        own = "its own per-sequence geometric mean" if objective == "gmpo" else "no policy ratio"
        if objective in TOKEN_RATIO_OBJECTIVES:
            own = "the token ratio (its mask or gate is per token probability)"
        out.append(f"policy_objective={objective!r} uses {own}: unset ratio_level={cfg.ratio_level!r}")
    if objective == "gmpo":
        out.extend(_gmpo_contradictions(cfg))
    return out


def _gmpo_contradictions(cfg: ClippedPGLossConfig) -> list[str]:
    """GMPO's loss is one value per sequence: only a per-sequence mean and per-sequence IS weights keep it one."""
    out = []
    if cfg.effective_loss_aggregation != "seq-mean-token-mean":
        out.append(
            f"policy_objective='gmpo' is a per-sequence loss averaged over sequences; loss_aggregation="
            f"{cfg.effective_loss_aggregation!r} would weight sequences by their length: set loss_aggregation: "
            "seq-mean-token-mean"
        )
    if cfg.use_importance_sampling_correction and cfg.effective_is_level != "sequence_mean":
        out.append(
            f"policy_objective='gmpo' needs one IS weight per sequence, the geometric mean (as verl's geo_mean): "
            f"set is_correction_level: sequence_mean (got {cfg.effective_is_level!r})"
        )
    token_rules = [rule.name for rule in cfg.rejection_rules if rule.aggregation == "token"]
    if token_rules:
        out.append(
            "policy_objective='gmpo' rejects whole sequences only: a token rejection rule would scale the sequence's "
            f"loss by its kept fraction; use a sequence rule instead of {', '.join(token_rules)}"
        )
    return out
