"""verl's vocabulary -> plugin keys (adapters/verl/config.py), without verl: every rollout_correction key mapped or
refused, the presets, the actor's other-loss keys, the Hydra section, and the docs table naming every key."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

from nemo_is_plugin.adapters.verl.config import (
    OTHER_ACTOR_KEYS,
    OTHER_LOSS_KEYS,
    PRESETS,
    ROLLOUT_CORRECTION_KEYS,
    VerlConfigError,
    actor_keys,
    plugin_section_keys,
    preset_keys,
    rejection_rules,
    rollout_correction_keys,
)
from nemo_is_plugin.loss.config_model import ClippedPGLossConfig

DOCS = Path(__file__).resolve().parents[2] / "docs" / "verl.md"


@pytest.mark.parametrize(
    "rc, want",
    [
        ({}, {}),
        (
            {"rollout_is": "token"},
            dict(
                use_importance_sampling_correction=True,
                is_correction_level="token",
                truncated_importance_sampling_type="tis",
                truncated_importance_sampling_ratio=2.0,
            ),
        ),
        (
            {"rollout_is": "sequence", "rollout_is_threshold": "5", "rollout_is_batch_normalize": True},
            dict(
                use_importance_sampling_correction=True,
                is_correction_level="sequence",
                truncated_importance_sampling_type="tis",
                truncated_importance_sampling_ratio=5.0,
                importance_sampling_batch_normalize=True,
            ),
        ),
        (
            {"rollout_is": "token", "rollout_is_threshold": "0.5_5.0"},
            dict(
                use_importance_sampling_correction=True,
                is_correction_level="token",
                truncated_importance_sampling_type="icepop",
                truncated_importance_sampling_ratio=5.0,
                truncated_importance_sampling_ratio_min=0.5,
            ),
        ),
        ({"rollout_is": "token", "rollout_is_threshold": None}, {}),  # verl: no threshold, no IS
        (
            {"rollout_rs": "seq_mean_k3", "rollout_rs_threshold": 0.01},
            dict(importance_sampling_rejection_rules=[dict(statistic="k3", aggregation="sequence_mean", max=0.01)]),
        ),
        ({"bypass_mode": True}, dict(old_policy_logprobs="generation")),
        (
            {"bypass_mode": True, "loss_type": "reinforce"},
            dict(old_policy_logprobs="generation", policy_objective="reinforce", ratio_clip_c=None),
        ),
        ({"_target_": "verl.trainer.config.RolloutCorrectionConfig"}, {}),
    ],
)
def test_rollout_correction_keys_map(rc, want):
    got = rollout_correction_keys(rc)
    assert got == want
    ClippedPGLossConfig(reference_policy_kl_penalty=0.0, **got)  # a valid plugin config


def test_rollout_rs_lists_follow_verls_rules():
    """Comma list, duplicates dropped, one threshold for all or one per option."""
    assert [r["max"] for r in rejection_rules("token_k2, token_k2", 0.05)] == [0.05]
    rules = rejection_rules("token_k1,seq_sum_k3", "0.5_2.0,1.0")
    assert rules == [
        dict(statistic="k1", aggregation="token", min=math.log(0.5), max=math.log(2.0)),
        dict(statistic="k3", aggregation="sequence_sum", max=1.0),
    ]
    assert [r["max"] for r in rejection_rules("seq_max_k2,seq_mean_k3", 2.0)] == [2.0, 2.0]
    with pytest.raises(VerlConfigError, match="3 entries for 2 rollout_rs options"):
        rejection_rules("seq_max_k2,seq_mean_k3", "1,2,3")
    with pytest.raises(VerlConfigError, match="needs rollout_rs_threshold"):
        rejection_rules("seq_max_k2", None)


@pytest.mark.parametrize(
    "rc, match",
    [
        ({"rollout_token_veto_threshold": 1e-4}, "replaced in verl by rollout_rs: seq_max_k2"),
        ({"rollout_is_level": "token"}, r"not verl's keys"),
        ({"rollout_is": "geometric"}, "must be 'token', 'sequence' or null"),
        ({"loss_type": "ppo"}, "must be 'ppo_clip' or 'reinforce'"),
        ({"rollout_is": "token", "rollout_is_threshold": "2_1"}, "lower <= upper"),
        ({"rollout_is": "token", "rollout_is_threshold": True}, "must be a number.*not a boolean"),
        ({"rollout_is": "token", "rollout_is_threshold": [2.0]}, r"must be a number.*got \[2\.0\]"),
        ({"rollout_rs": "token_k4", "rollout_rs_threshold": 1.0}, "not one of verl's"),
    ],
)
def test_rollout_correction_refusals_say_why(rc, match):
    with pytest.raises(ValueError, match=match):
        rollout_correction_keys(rc)


def test_a_boolean_threshold_is_a_type_error_that_says_not_a_boolean():
    """verl's own test (tests/trainer/ppo/test_rollout_corr.py) expects TypeError matching "not a boolean"."""
    with pytest.raises(TypeError, match="not a boolean"):
        rollout_correction_keys({"rollout_is": "token", "rollout_is_threshold": False})


@pytest.mark.parametrize(
    "rc, key",
    [
        ({"rollout_is_batch_normalize": True}, "rollout_is_batch_normalize"),
        ({"loss_type": "reinforce"}, "loss_type"),
        ({"rollout_is": "token", "bypass_mode": True}, "rollout_is"),
    ],
)
def test_keys_verl_ignores_are_ignored_with_a_warning(rc, key):
    with pytest.warns(UserWarning, match=f"rollout_correction.{key} is ignored, as verl ignores it"):
        got = rollout_correction_keys(rc)
    assert "use_importance_sampling_correction" not in got and "importance_sampling_batch_normalize" not in got


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_resolves_to_a_valid_config(name):
    cfg = ClippedPGLossConfig(reference_policy_kl_penalty=0.0, **preset_keys(name))
    assert cfg.bypasses_prev == name.startswith("bypass")
    assert bool(cfg.rejection_rules) == ("_rs" in name)


def test_preset_keywords_and_names_are_checked():
    assert preset_keys("decoupled_k3_rs", rs_threshold=0.05)["importance_sampling_rejection_rules"][0]["max"] == 0.05
    with pytest.raises(VerlConfigError, match="unknown verl rollout-correction preset 'tis'"):
        preset_keys("tis")
    with pytest.raises(VerlConfigError, match=r"takes \['rs_threshold'\], not \['threshold'\]"):
        preset_keys("decoupled_geo_rs", threshold=2.0)


def test_actor_keys_and_other_losses_settings():
    keys = actor_keys({"clip_ratio": 0.2, "clip_ratio_high": 0.28, "clip_ratio_c": 10.0}, "token-sum")
    assert keys["ratio_clip_max"] == 0.28 and keys["ratio_clip_c"] == 10.0 and keys["token_level_loss"]
    for key, (_default, loss) in {**OTHER_LOSS_KEYS, **OTHER_ACTOR_KEYS}.items():
        actor = {key: 0.5} if key in OTHER_ACTOR_KEYS else {"policy_loss": {key: 0.5}}
        with pytest.raises(VerlConfigError, match=f"{key}=0.5 configures verl's '{loss}' loss"):
            actor_keys(actor, "token-mean")
    changed = {"policy_loss": {"rollout_correction": {"rollout_is": "token"}}}
    with pytest.raises(VerlConfigError, match="policy_loss.nemo_is.rollout_correction"):
        actor_keys(changed, "token-mean")
    default = {"policy_loss": {"rollout_correction": {"rollout_is": "sequence", "rollout_is_threshold": 2.0}}}
    actor_keys(default, "token-mean")  # verl's dataclass default: not the user's


def test_plugin_section_forms():
    assert (
        plugin_section_keys({"rollout_correction": "decoupled_token_is", "truncated_importance_sampling_ratio": 3})[
            "truncated_importance_sampling_ratio"
        ]
        == 3
    )  # plugin keys win
    assert (
        plugin_section_keys({"rollout_correction": {"preset": "decoupled_token_is", "threshold": 4.0}})[
            "truncated_importance_sampling_ratio"
        ]
        == 4.0
    )
    assert plugin_section_keys({"rollout_correction": {"rollout_is": "sequence"}})["is_correction_level"] == "sequence"
    section = {"ratio_level": "cumulative", "name": "nemo_is.clipped_pg"}
    assert plugin_section_keys(section) == {"ratio_level": "cumulative"}


def test_docs_table_names_every_verl_key():
    """docs/verl.md: one table, a row per verl key (mapped, or refused with the reason)."""
    text = DOCS.read_text()
    rows = set()
    for first_cell in re.findall(r"^\| (`[^|]+?) \|", text, flags=re.M):
        names = re.findall(r"`([^`]+)`", first_cell)
        prefix = names[0].rsplit(".", 1)[0] + "."  # `actor.a` / `b`: b is actor.b
        rows |= {n if "." in n else prefix + n for n in names}
    wanted = (
        {f"algorithm.rollout_correction.{k}" for k in ROLLOUT_CORRECTION_KEYS}
        | {f"actor.policy_loss.{k}" for k in OTHER_LOSS_KEYS}
        | {f"actor.{k}" for k in OTHER_ACTOR_KEYS}
        | {
            "actor.clip_ratio",
            "actor.clip_ratio_low",
            "actor.clip_ratio_high",
            "actor.clip_ratio_c",
            "actor.loss_agg_mode",
            "actor.loss_scale_factor",
            "actor.policy_loss.loss_mode",
            "actor.policy_loss.rollout_correction",
            "actor.global_batch_info",
        }
    )
    wanted |= {f"actor.{k}" for k in ("use_kl_loss", "kl_loss_coef", "kl_loss_type", "entropy_coeff")}
    assert wanted <= rows, sorted(wanted - rows)
    for name in PRESETS:
        assert f"`{name}`" in text, name


def test_bypass_reinforce_names_its_objective_and_refuses_another():
    """rollout_correction's loss_type: reinforce writes policy_objective: reinforce (not NeMo-RL's disable_ppo_ratio);
    a policy_objective of the section naming another objective is refused rather than winning silently."""
    rc = {"bypass_mode": True, "loss_type": "reinforce"}
    keys = plugin_section_keys({"rollout_correction": rc})
    cfg = ClippedPGLossConfig(reference_policy_kl_penalty=0.0, **keys)
    assert (cfg.effective_objective, cfg.objective_switch, cfg.disable_ppo_ratio) == ("reinforce", None, False)
    assert plugin_section_keys({"rollout_correction": rc, "policy_objective": "reinforce"}) == keys
    with pytest.raises(VerlConfigError, match="loss_type: reinforce .* and policy_objective='sapo' both choose"):
        plugin_section_keys({"rollout_correction": rc, "policy_objective": "sapo"})
