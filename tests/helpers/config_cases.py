"""Config fixtures shared by the config tests."""

from __future__ import annotations

from typing import Any

from nemo_is_plugin.loss.config_model import NUMERIC_RANGES, ClippedPGLossConfig
from nemo_is_plugin.loss.objectives import BUILTIN_OBJECTIVES, OBJECTIVES, key_sections

# The project's tests enumerate this package's own objectives and keys only, so that they hold whatever other
# package's objective is installed (the example package of examples/tapered_reinforce/ is, in CI).
BUILTIN_SECTIONS = [(section, names) for section, names in key_sections() if set(names) & set(BUILTIN_OBJECTIVES)]
_OTHER_PACKAGES_KEYS = {key for section, names in key_sections() if (section, names) not in BUILTIN_SECTIONS
                        for key in section.own_keys()}  # fmt: skip
BUILTIN_FIELDS: tuple[str, ...] = tuple(k for k in ClippedPGLossConfig.model_fields if k not in _OTHER_PACKAGES_KEYS)
BUILTIN_RANGES = {key: r for key, r in NUMERIC_RANGES.items() if key not in _OTHER_PACKAGES_KEYS}

# For each numeric config key: the smallest companion keys that make it active (read by the loss), so that a test
# setting the key alone can only fail on the key's own value. A policy objective's key is active once its objective is
# chosen (_objective_keys below); the keys listed here need more (another required key, an aggregation, a pair).
_COMPANIONS: dict[str, dict[str, Any]] = {
    "reference_policy_kl_penalty": {},
    "kl_input_clamp_value": {},
    "kl_output_clamp_value": {},
    "ratio_clip_min": {},
    "ratio_clip_max": {},
    "ratio_clip_c": {},
    "truncated_importance_sampling_ratio": dict(
        use_importance_sampling_correction=True, truncated_importance_sampling_type="tis"
    ),
    "truncated_importance_sampling_ratio_min": dict(
        use_importance_sampling_correction=True,
        truncated_importance_sampling_type="icepop",
        truncated_importance_sampling_ratio=5.0,
    ),
    "positive_example_nll_weight": {},
    "log_ratio_clip_low": dict(log_ratio_clip_high=0.05),
    "log_ratio_clip_high": dict(log_ratio_clip_low=0.025),
    "log_ratio_clip_c": dict(log_ratio_clip_low=0.025, log_ratio_clip_high=0.05),
    "clip_position_power": dict(log_ratio_clip_low=0.025, log_ratio_clip_high=0.05),
    "token_log_ratio_clamp": {},
    "max_log_ratio": {},
    "importance_sampling_rejection_min": dict(
        importance_sampling_rejection="geo-rs", importance_sampling_rejection_max=1.001
    ),
    "importance_sampling_rejection_max": dict(
        importance_sampling_rejection="geo-rs", importance_sampling_rejection_min=0.999
    ),
    "importance_sampling_veto_threshold": {},
    "loss_aggregation_norm": dict(loss_aggregation="seq-mean-token-sum-norm"),
    "score_centering_top_k": dict(score_centering=True),
    "score_centering_tail_floor": dict(score_centering=True),
    "dppo_delta_low": dict(policy_objective="dppo_tv", dppo_delta_high=0.28),
    "dppo_delta_high": dict(policy_objective="dppo_tv", dppo_delta_low=0.2),
    "dppo_ratio_cap": dict(policy_objective="dppo_kl", dppo_delta_low=0.2, dppo_delta_high=0.28),
    "gmpo_clip_low": dict(policy_objective="gmpo", gmpo_clip_high=0.4, loss_aggregation="seq-mean-token-mean"),
    "gmpo_clip_high": dict(policy_objective="gmpo", gmpo_clip_low=0.4, loss_aggregation="seq-mean-token-mean"),
}


def _objective_keys() -> dict[str, dict[str, Any]]:
    """Each built-in objective's keys, activated by choosing it: where it requires no key other than the one set,
    a new objective's keys need no line here (one that needs more fails the config tests naming the key)."""
    out: dict[str, dict[str, Any]] = {}
    for section, names in BUILTIN_SECTIONS:
        for key in section.model_fields:
            if set(OBJECTIVES[names[0]].required) <= {key}:
                out[key] = {"policy_objective": names[0]}
    return out


ACTIVATING_KEYS: dict[str, dict[str, Any]] = {**_objective_keys(), **_COMPANIONS}
