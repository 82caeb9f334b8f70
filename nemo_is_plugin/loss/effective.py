"""What a validated loss config actually does, resolved: every derived choice in words (``nemo-is validate
--show-effective``). Imports no torch itself; each policy objective words its own trust region and ratio.

The config leaves several choices implicit (an unset ``ratio_level`` follows ``sequence_level_importance_ratios``, an
unset aggregation follows ``token_level_loss``, ``use_kl_in_reward`` moves beta out of the loss, ...); this module
spells each one out, with where it came from.
"""

from __future__ import annotations

from nemo_is_plugin.loss.config_model import ClippedPGLossConfig
from nemo_is_plugin.loss.objectives.base import NEMO_RL_SWITCHES
from nemo_is_plugin.loss.objectives.ppo_clip import PPOClipKeys


def _g(x: float | None) -> str:
    """A number as the config shows it; an unset bound (which a validated config never reads here) as YAML's null."""
    return "null" if x is None else f"{x:g}"


def _objective(cfg: ClippedPGLossConfig) -> str:
    """The objective computed and what chose it: ``policy_objective``, or the NeMo-RL switch that selects it."""
    name, switch = cfg.effective_objective, cfg.objective_switch
    if switch is None:
        return f"{name} ({'policy_objective' if 'policy_objective' in cfg.model_fields_set else 'default'})"
    later = [s for s, _ in NEMO_RL_SWITCHES if s != switch and getattr(cfg, s)]
    shadowed = f"; {', '.join(later)}: true ignored, as NeMo-RL tests {switch} first" if later else ""
    return f"{name} (selected by NeMo-RL's {switch}: true{shadowed})"


def _ratio(cfg: ClippedPGLossConfig) -> str:
    own = cfg.objective.describe_ratio(cfg)
    if own is not None:
        return own
    level = cfg.effective_ratio_level
    source = (
        "ratio_level"
        if cfg.ratio_level is not None
        else (
            "from sequence_level_importance_ratios=true" if cfg.sequence_level_importance_ratios else "NeMo-RL default"
        )
    )
    return f"{level} ({source})"


def _log_ratio_guards(cfg: ClippedPGLossConfig) -> str:
    parts = []
    if cfg.token_log_ratio_clamp is not None:
        parts.append(f"each token log-ratio clamped to +-{_g(cfg.token_log_ratio_clamp)}")
    cap = PPOClipKeys.of(cfg).max_log_ratio
    if cap is not None:
        parts.append(f"log r capped at {_g(cap)}")
    return "; ".join(parts) or "none"


def _is_level(cfg: ClippedPGLossConfig) -> str:
    level = cfg.effective_is_level
    if cfg.is_correction_level is not None:
        return f"{level} (is_correction_level; log-space, saturates at w = e^30)"
    source = "from sequence_level_importance_ratios=true" if cfg.sequence_level_importance_ratios else "default"
    return f"{level} ({source}; NeMo-RL's float32 path: an overflowing weight becomes 0)"


def _truncation(cfg: ClippedPGLossConfig) -> str:
    t = cfg.truncated_importance_sampling_type
    if t is None:
        return "none"
    lo = cfg.truncated_importance_sampling_ratio_min
    band = f"[{_g(lo if lo is not None else 0.0)}, {_g(cfg.truncated_importance_sampling_ratio)}]"
    what = {
        "tis": "clamp the weight to",
        "icepop": "zero token weights outside",
        "seq-mask-tis": "zero a sequence's weights when its geometric-mean weight is outside",
        "seq-mis": "reject a sequence when exp(sum x) is outside",
        "geo-rs": "reject a sequence when exp(mean x) is outside",
    }[t]
    return f"{t}: {what} {band}"


def _rejection(cfg: ClippedPGLossConfig) -> str:
    parts = []
    if cfg.importance_sampling_rejection is not None:
        parts.append(
            f"{cfg.importance_sampling_rejection} outside [{_g(cfg.importance_sampling_rejection_min)}, "
            f"{_g(cfg.importance_sampling_rejection_max)}] (on top of the truncation)"
        )
    for rule in cfg.importance_sampling_rejection_rules:
        parts.append(f"rule {rule.name}: keep while {_rule_band(rule.statistic, rule.min, rule.max)}")
    if cfg.importance_sampling_veto_threshold is not None:
        parts.append(f"veto a sequence with a token weight < {_g(cfg.importance_sampling_veto_threshold)}")
    return "; ".join(parts) or "none"


def _rule_band(statistic: str, low: float | None, high: float | None) -> str:
    what = "|pi_prev - mu|" if statistic == "prob_diff" else statistic
    return (f"{_g(low)} <= " if low is not None else "") + what + (f" <= {_g(high)}" if high is not None else "")


def _kl(cfg: ClippedPGLossConfig) -> str:
    if cfg.use_kl_in_reward:
        return f"in the reward (use_kl_in_reward; beta {_g(cfg.reference_policy_kl_penalty)} is not in the loss)"
    if cfg.reference_policy_kl_penalty == 0:
        return "off (reference_policy_kl_penalty = 0; no reference log-probs are read)"
    clamps = []
    if cfg.kl_input_clamp_value is not None:
        clamps.append(f"input +-{_g(cfg.kl_input_clamp_value)}")
    if cfg.kl_output_clamp_value is not None:
        clamps.append(f"output +-{_g(cfg.kl_output_clamp_value)}")
    weight = "exp(c - g) (on-policy approximation)" if cfg.use_on_policy_kl_approximation else "exp(c - sg[c])"
    grad = "k2 (straight-through)" if cfg.reference_policy_kl_gradient == "k2" else "the estimator's own"
    return (
        f"{cfg.reference_policy_kl_type}, beta {_g(cfg.reference_policy_kl_penalty)}, clamps "
        f"{', '.join(clamps) or 'none'}, weight {weight}, gradient {grad}"
    )


def _aggregation(cfg: ClippedPGLossConfig) -> str:
    agg = cfg.effective_loss_aggregation
    source = "loss_aggregation" if cfg.loss_aggregation is not None else f"from token_level_loss={cfg.token_level_loss}"
    norm = f", divisor {_g(cfg.loss_aggregation_norm)}" if cfg.loss_aggregation_norm is not None else ""
    return f"{agg} ({source}{norm}; over the global valid token / sequence counts)"


def _score_centering(cfg: ClippedPGLossConfig) -> str:
    if not cfg.score_centering:
        return "off"
    kind = cfg.truncated_importance_sampling_type if cfg.use_importance_sampling_correction else None
    lo, hi = _g(cfg.truncated_importance_sampling_ratio_min or 0), _g(cfg.truncated_importance_sampling_ratio)
    f = {None: "1", "tis": f"clamp(r, {lo}, {hi})", "icepop": f"r 1[{lo} <= r <= {hi}]"}.get(kind, str(kind))
    k = "the data's" if cfg.score_centering_top_k is None else str(cfg.score_centering_top_k)
    return f"on: f(r) = {f}, head k = {k}, tail floor {_g(cfg.score_centering_tail_floor)}"


def effective_settings(cfg: ClippedPGLossConfig) -> dict[str, str]:
    """Every effective choice of ``cfg`` in words, in the loss's order (objective, ratio, clip, IS, KL,
    aggregation)."""
    is_on = cfg.use_importance_sampling_correction
    return {
        "policy objective": _objective(cfg),
        "policy ratio": _ratio(cfg),
        "ratio clip": cfg.objective.describe(cfg),
        "log-ratio guards": _log_ratio_guards(cfg),
        "IS correction": "applied to the loss" if is_on else "off (weights are still computed for the metrics)",
        "IS level": _is_level(cfg),
        "IS truncation": _truncation(cfg),
        "IS rejection": _rejection(cfg),
        "IS batch normalisation": "on (divide by the batch mean)" if cfg.importance_sampling_batch_normalize else "off",
        "KL to the reference": _kl(cfg),
        "aggregation": _aggregation(cfg),
        "positive-example NLL": (
            f"weight {_g(cfg.positive_example_nll_weight)}" if cfg.positive_example_nll_weight else "off"
        ),
        "score centering": _score_centering(cfg),
    }


__all__ = ["effective_settings"]
