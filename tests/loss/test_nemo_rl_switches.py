"""objectives/nemo_rl_switches.py: NeMo-RL's switches -> the objective, in NeMo-RL's precedence, from a config or from
an adapter's mapping of keys; and the host clip keys the selected objective leaves unread (base.unread_clip_keys)."""

from __future__ import annotations

import pytest

from nemo_is_plugin.loss.config_model import ClippedPGLossConfig
from nemo_is_plugin.loss.objectives import objective_of, objective_of_keys, unread_clip_keys
from nemo_is_plugin.loss.objectives.nemo_rl_switches import effective_objective, selecting_switch

CASES = [
    ({}, None, "ppo_clip"),
    ({"policy_objective": "ppo_clip", "use_cispo": True}, "use_cispo", "cispo"),
    ({"disable_ppo_ratio": True}, "disable_ppo_ratio", "reinforce"),
    ({"force_on_policy_ratio": True}, "force_on_policy_ratio", "on_policy"),
    ({"force_on_policy_ratio": True, "disable_ppo_ratio": True}, "force_on_policy_ratio", "on_policy"),  # NeMo-RL
    ({"policy_objective": "cispo"}, None, "cispo"),
    ({"policy_objective": "cispo", "use_cispo": True}, None, "cispo"),
    ({"policy_objective": "sapo"}, None, "sapo"),
]


@pytest.mark.parametrize("keys, switch, name", CASES, ids=[str(k) for k, _, _ in CASES])
def test_the_switch_selects_the_objective_from_a_mapping_and_a_config(keys, switch, name):
    chosen = keys.get("policy_objective", "ppo_clip")
    assert selecting_switch(chosen, keys) == switch and effective_objective(chosen, keys) == name
    assert objective_of_keys(keys).name == name
    cfg = ClippedPGLossConfig(**keys)
    assert cfg.effective_objective == name and objective_of(cfg).name == name


@pytest.mark.parametrize(
    "keys, unread",
    [
        ({}, ()),
        ({"use_cispo": True}, ("ratio_clip_c",)),
        ({"policy_objective": "cispo"}, ("ratio_clip_c",)),
        ({"disable_ppo_ratio": True}, ()),  # NeMo-RL ignores the band under its switch: left as the host set it
        ({"policy_objective": "reinforce"}, ("ratio_clip_min", "ratio_clip_max")),
        ({"force_on_policy_ratio": True}, ()),
        ({"policy_objective": "on_policy"}, ("ratio_clip_min", "ratio_clip_max")),
        ({"policy_objective": "gpg"}, ("ratio_clip_min", "ratio_clip_max", "ratio_clip_c")),
    ],
)
def test_unread_clip_keys(keys, unread):
    assert unread_clip_keys(keys) == unread
