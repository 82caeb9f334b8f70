"""Score centering in the config: the compositions it refuses, each with its reason in one line and valid without it,
and its own keys refused without it. Its inputs and wiring: test_score_centering.py."""

from __future__ import annotations

import pydantic
import pytest

from nemo_is_plugin.loss.config_model import ClippedPGLossConfig

IS_TIS = {
    "use_importance_sampling_correction": True,
    "truncated_importance_sampling_type": "tis",
    "truncated_importance_sampling_ratio": 2.0,
}
REFUSED = {
    "objective": ({"policy_objective": "dppo_tv", "dppo_delta_low": 0.2, "dppo_delta_high": 0.2}, "use ppo_clip"),
    "gspo": ({"sequence_level_importance_ratios": True, "token_level_loss": False}, "use ratio_level: token"),
    "ctpo": ({"ratio_level": "cumulative"}, "use ratio_level: token"),
    "sequence IS": ({**IS_TIS, "is_correction_level": "sequence_mean"}, "use is_correction_level: token"),
    "untruncated IS": ({"use_importance_sampling_correction": True}, "centring coefficients are exactly 0"),
    "geo-rs": (
        {
            "truncated_importance_sampling_type": "geo-rs",
            "truncated_importance_sampling_ratio": 1.001,
            "truncated_importance_sampling_ratio_min": 0.999,
        },
        "a rejection reads the sampled token itself",
    ),
    "rejection": (
        {
            **IS_TIS,
            "importance_sampling_rejection": "seq-mis",
            "importance_sampling_rejection_min": 0.5,
            "importance_sampling_rejection_max": 2.0,
        },
        "a rejection reads the sampled token itself",
    ),
    "veto": ({"importance_sampling_veto_threshold": 1e-4}, "a rejection reads the sampled token itself"),
    "bypass with the PPO ratio": ({"old_policy_logprobs": "generation"}, "set disable_ppo_ratio: true"),
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_refused_compositions_say_why_in_one_line(name):
    keys, match = REFUSED[name]
    with pytest.raises(pydantic.ValidationError, match=match) as err:
        ClippedPGLossConfig(score_centering=True, **keys)
    assert "score_centering" in str(err.value)
    ClippedPGLossConfig(**keys)  # valid without score centering


@pytest.mark.parametrize("key, value", [("score_centering_top_k", 32), ("score_centering_tail_floor", 1e-4)])
def test_its_keys_are_refused_without_it(key, value):
    with pytest.raises(pydantic.ValidationError, match=f"{key} is read with score_centering: true only"):
        ClippedPGLossConfig(**{key: value})
    assert getattr(ClippedPGLossConfig(score_centering=True, **{key: value}), key) == value
