"""The loss's whole config space as factors, and a pairwise covering grid of valid configs over it.

Each factor is one independent choice of :class:`~nemo_is_plugin.ClippedPGLossConfig`: the policy objective, the
ratio level, the clip, pi_old, the IS switch and level, the truncation type, a rejection (band, rule or none), the
veto, the KL (type, straight-through gradient, clamps, weight, off), the aggregation, batch normalisation, the
positive-example NLL, the input mode and score centering. A value is the config keys it sets (with the companion keys
it needs); the first value of each factor is the neutral one (NeMo-RL's default or off).

:func:`config_grid` returns configs covering every pair of values that a valid config can hold (``helpers.covering``);
a candidate the config refuses is skipped and counted. The pairs no valid config holds are the config's own
contradictions (``INFEASIBLE_REASONS`` names them, by factor pair).
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

from helpers.covering import Covering, Row, covering_rows
from nemo_is_plugin import ClippedPGLossConfig
from nemo_is_plugin.config import ConfigError

_DPPO = dict(dppo_delta_low=0.2, dppo_delta_high=0.28)
FACTORS: dict[str, dict[str, dict[str, Any]]] = {
    "objective": {
        "ppo_clip": {},
        "dppo_tv": dict(policy_objective="dppo_tv", **_DPPO),
        "dppo_kl": dict(policy_objective="dppo_kl", **_DPPO),
        "prob_diff": dict(policy_objective="prob_diff"),
        "cppo": dict(policy_objective="cppo"),
        "sapo": dict(policy_objective="sapo"),
        "gmpo": dict(policy_objective="gmpo", gmpo_clip_low=0.4, gmpo_clip_high=0.4),
        "gpg": dict(policy_objective="gpg"),
        "dro": dict(policy_objective="dro", dro_beta=0.1),
    },
    "ratio": {
        "unset": {},
        "token": dict(ratio_level="token"),
        "sequence": dict(ratio_level="sequence"),
        "sequence_token": dict(ratio_level="sequence_token"),
        "cumulative": dict(ratio_level="cumulative"),
        "cumulative_mean": dict(ratio_level="cumulative_mean"),
        "gspo_nemo_rl": dict(sequence_level_importance_ratios=True, token_level_loss=False),
    },
    "clip": {
        "ratio": {},
        "dual": dict(ratio_clip_c=3.0),
        "log_space": dict(log_ratio_clip_low=0.025, log_ratio_clip_high=0.05, clip_position_power=0.5),
        "log_space_dual": dict(log_ratio_clip_low=0.2, log_ratio_clip_high=0.28, log_ratio_clip_c=1.0),
        "capped": dict(max_log_ratio=10.0, token_log_ratio_clamp=20.0),
        "cispo": dict(use_cispo=True, ratio_clip_min=1.0, ratio_clip_max=5.0),
        "reinforce": dict(disable_ppo_ratio=True),
        "force_on_policy": dict(force_on_policy_ratio=True),
    },
    "old_policy": {"prev": {}, "generation": dict(old_policy_logprobs="generation")},
    "is": {"off": {}, "on": dict(use_importance_sampling_correction=True)},
    "is_level": {
        "unset": {},
        "token": dict(is_correction_level="token"),
        "sequence": dict(is_correction_level="sequence"),
        "sequence_mean": dict(is_correction_level="sequence_mean"),
        "cumulative": dict(is_correction_level="cumulative"),
    },
    "truncation": {
        "none": {},
        **{
            name: dict(
                truncated_importance_sampling_type=kind,
                truncated_importance_sampling_ratio=high,
                truncated_importance_sampling_ratio_min=low,
            )
            for name, kind, low, high in (
                ("tis", "tis", None, 2.0),
                ("tis_min", "tis", 0.5, 2.0),
                ("icepop", "icepop", 0.5, 5.0),
                ("seq-mask-tis", "seq-mask-tis", 0.8, 1.25),
                ("seq-mis", "seq-mis", 0.5, 2.0),
                ("geo-rs", "geo-rs", 0.8, 1.25),
            )
        },
    },
    "rejection": {
        "none": {},
        "seq-mis_band": dict(
            importance_sampling_rejection="seq-mis",
            importance_sampling_rejection_min=0.5,
            importance_sampling_rejection_max=2.0,
        ),
        "geo-rs_band": dict(
            importance_sampling_rejection="geo-rs",
            importance_sampling_rejection_min=0.8,
            importance_sampling_rejection_max=1.25,
        ),
        "token_k1": dict(importance_sampling_rejection_rules=[{"option": "token_k1", "threshold": "0.5_2.0"}]),
        "seq_max_k2": dict(importance_sampling_rejection_rules=[{"option": "seq_max_k2", "threshold": 2.0}]),
        "seq_sum_k3": dict(
            importance_sampling_rejection_rules=[{"statistic": "k3", "aggregation": "sequence_sum", "max": 5.0}]
        ),
        "seq_mean_k1_unclamped": dict(
            importance_sampling_rejection_rules=[
                {"statistic": "k1", "aggregation": "sequence_mean", "min": -1.0, "max": 1.0, "log_ratio_clamp": None}
            ]
        ),
        "token_prob_diff": dict(
            importance_sampling_rejection_rules=[{"statistic": "prob_diff", "aggregation": "token", "max": 0.5}]
        ),
    },
    "veto": {"off": {}, "on": dict(importance_sampling_veto_threshold=1e-4)},
    "kl": {
        "off": dict(reference_policy_kl_penalty=0.0),
        "k1": dict(reference_policy_kl_penalty=0.05, reference_policy_kl_type="k1"),
        "k2": dict(reference_policy_kl_penalty=0.05, reference_policy_kl_type="k2"),
        "k3": dict(reference_policy_kl_penalty=0.05, reference_policy_kl_type="k3"),
        "k1_k2_gradient": dict(
            reference_policy_kl_penalty=0.05, reference_policy_kl_type="k1", reference_policy_kl_gradient="k2"
        ),
        "k3_k2_gradient": dict(
            reference_policy_kl_penalty=0.05, reference_policy_kl_type="k3", reference_policy_kl_gradient="k2"
        ),
        "k3_unclamped": dict(reference_policy_kl_penalty=0.05, kl_input_clamp_value=None, kl_output_clamp_value=None),
        "k3_on_policy_weight": dict(reference_policy_kl_penalty=0.05, use_on_policy_kl_approximation=True),
        "in_reward": dict(reference_policy_kl_penalty=0.05, use_kl_in_reward=True),
    },
    "aggregation": {
        "unset": {},
        "token-mean": dict(loss_aggregation="token-mean"),
        "token-sum": dict(loss_aggregation="token-sum"),
        "seq-mean-token-mean": dict(loss_aggregation="seq-mean-token-mean"),
        "seq-mean-token-sum": dict(loss_aggregation="seq-mean-token-sum"),
        "seq-mean-token-sum-norm": dict(loss_aggregation="seq-mean-token-sum-norm", loss_aggregation_norm=8.0),
    },
    "batch_normalize": {"off": {}, "on": dict(importance_sampling_batch_normalize=True)},
    "nll": {"off": {}, "on": dict(positive_example_nll_weight=0.1)},
    "inputs": {"tolerant": {}, "strict": dict(strict_input_checks=True)},
    "score_centering": {"off": {}, "on": dict(score_centering=True, score_centering_top_k=3)},
}


def config_kwargs(row: Row) -> dict[str, Any]:
    kw: dict[str, Any] = {}
    for factor, value in row.items():
        kw.update(FACTORS[factor][value])
    return kw


def build(row: Row) -> ClippedPGLossConfig:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return ClippedPGLossConfig(**config_kwargs(row))


def violations(row: Row) -> int:
    """How many contradictions the config of ``row`` has (0: valid); the config joins them with '; '."""
    try:
        build(row)
    except ConfigError as exc:
        return str(exc).count("; ") + 1
    return 0


@functools.cache
def config_grid() -> Covering:
    """Rows covering every feasible pair of factor values (deterministic; ~30 s to build on one core). Six repair
    moves: score centering with batch normalisation needs two coordinated changes from the neutral row (the IS switch
    and a truncation), which four random sideways moves do not always find."""
    return covering_rows({f: list(values) for f, values in FACTORS.items()}, violations, seed=0, repairs=6)


def row_id(row: Row) -> str:
    """A short test id: the non-neutral values."""
    return "-".join(v for f, v in row.items() if v != next(iter(FACTORS[f]))) or "defaults"
