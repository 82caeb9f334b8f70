"""Config fixtures shared by the config tests."""

from __future__ import annotations

from typing import Any

# For each numeric config key: the smallest companion keys that make it active (read by the loss), so that a test
# setting the key alone can only fail on the key's own value.
ACTIVATING_KEYS: dict[str, dict[str, Any]] = {
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
    "prob_diff_threshold": dict(policy_objective="prob_diff"),
    "cppo_delta": dict(policy_objective="cppo"),
    "cppo_w_min": dict(policy_objective="cppo"),
    "cppo_delta_b": dict(policy_objective="cppo"),
    "sapo_tau_pos": dict(policy_objective="sapo"),
    "sapo_tau_neg": dict(policy_objective="sapo"),
    "gmpo_clip_low": dict(policy_objective="gmpo", gmpo_clip_high=0.4, loss_aggregation="seq-mean-token-mean"),
    "gmpo_clip_high": dict(policy_objective="gmpo", gmpo_clip_low=0.4, loss_aggregation="seq-mean-token-mean"),
    "dro_beta": dict(policy_objective="dro"),
    "m2po_budget": dict(policy_objective="m2po"),
    "m2po_clip_low_floor": dict(policy_objective="m2po"),
    "m2po_clip_high_floor": dict(policy_objective="m2po"),
}
