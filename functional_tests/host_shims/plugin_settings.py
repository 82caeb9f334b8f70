"""The plugin's settings the hosts' step tests share (the same keys in every host's section)."""

# CTPO's position-adaptive log-space clip on the cumulative ratio (arXiv 2605.07331), with the bounds the step tests
# use; each host's test adds its IS settings.
CTPO = {
    "ratio_level": "cumulative",
    "log_ratio_clip_low": 0.025,
    "log_ratio_clip_high": 0.05,
    "log_ratio_clip_c": 0.05,
    "clip_position_power": 0.5,
    "token_log_ratio_clamp": 20.0,
    "max_log_ratio": 10.0,
}

# NeMo-RL's loss_fn sections of the plugin's settings that both NeMo-RL steps (the DTensor and the Megatron
# worker's) run as they are; each test adds the settings built on its own base section.
NEMO_RL_CTPO = {
    "reference_policy_kl_penalty": 0.0,
    **CTPO,
    "use_importance_sampling_correction": True,
    "is_correction_level": "sequence_mean",
    "truncated_importance_sampling_type": "tis",
    "truncated_importance_sampling_ratio": 5.0,
}
NEMO_RL_M2PO = {
    "reference_policy_kl_penalty": 0.0,
    "policy_objective": "m2po",
    "use_importance_sampling_correction": True,
    "truncated_importance_sampling_type": "tis",
    "truncated_importance_sampling_ratio": 2.0,
}
# A seq-mis rejection rule (sequences whose geometric-mean IS ratio leaves [0.5, 2] are rejected), added to a section.
SEQ_MIS_REJECTION = {
    "importance_sampling_rejection": "seq-mis",
    "importance_sampling_rejection_min": 0.5,
    "importance_sampling_rejection_max": 2.0,
}
