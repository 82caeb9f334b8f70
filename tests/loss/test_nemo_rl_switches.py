"""objectives/nemo_rl_switches.py: NeMo-RL's switches -> the objective, in NeMo-RL's precedence, from a config or from
an adapter's mapping of keys; and the host clip keys the selected objective leaves unread (base.unread_clip_keys)."""

from __future__ import annotations

import pytest

from nemo_is_plugin.loss.config_model import ClippedPGLossConfig
from nemo_is_plugin.loss.objectives import objective_of, unread_clip_keys
from nemo_is_plugin.loss.objectives.nemo_rl_switches import (
    NEMO_RL_RATIO_KEYS,
    effective_objective,
    effective_objective_of_keys,
    selecting_switch,
)

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
    assert effective_objective_of_keys(keys) == name
    cfg = ClippedPGLossConfig(**keys)
    assert cfg.effective_objective == name and objective_of(cfg).name == name and cfg.objective is objective_of(cfg)
    assert cfg.objective_switch == switch


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


def test_the_objective_is_resolved_once_per_validation(monkeypatch):
    """The switches are read when the config validates (construction, assignment), not by each reader."""
    import nemo_is_plugin.loss.config_model as config_model

    calls = []
    real = config_model.resolve_objective
    monkeypatch.setattr(config_model, "resolve_objective", lambda *a: calls.append(1) or real(*a))
    cfg = ClippedPGLossConfig(disable_ppo_ratio=True)
    assert len(calls) == 1
    for _ in range(3):
        assert (cfg.effective_objective, cfg.objective_switch, cfg.objective.name) == (
            "reinforce",
            "disable_ppo_ratio",
            "reinforce",
        )
    assert len(calls) == 1
    cfg.disable_ppo_ratio = False  # an assignment validates again, and resolves again
    assert (cfg.effective_objective, cfg.objective_switch, len(calls)) == ("ppo_clip", None, 2)


def test_nemo_rl_ratio_keys_name_registered_objectives_and_nemo_rl_keys_only():
    from nemo_is_plugin.loss.objectives import OBJECTIVES
    from nemo_is_plugin.loss.objectives.nemo_rl_switches import NEMO_RL_CLIP_KEYS, RATIO_SWITCHES

    assert set(NEMO_RL_RATIO_KEYS) <= set(OBJECTIVES)
    for reads in NEMO_RL_RATIO_KEYS.values():
        assert set(reads.clip_keys) | set(reads.ignored) <= set(NEMO_RL_CLIP_KEYS)
        assert set(reads.switches) <= set(RATIO_SWITCHES)
    # every switch that selects an objective is accepted by the objective it selects
    for switch, name in (
        ("use_cispo", "cispo"),
        ("disable_ppo_ratio", "reinforce"),
        ("force_on_policy_ratio", "on_policy"),
    ):
        assert switch in NEMO_RL_RATIO_KEYS[name].switches
