"""A key of another host's vocabulary in a host's plugin section is applied the same way in every host (verl's
``rollout_correction`` presets and mappings in NeMo-RL's ``loss_fn``, slime's ``nemo_is``, verl's ``nemo_is`` and
``nemo-is validate``), or refused in one line naming that host's own key; each host's unknown-key warning names that
host. The reference is verl's own translation of the preset (``preset_keys``: tests/adapters/test_verl_config.py checks
it against verl 0.9.1), and the slime case compares the whole loss and gradient with the preset's keys written out."""

from __future__ import annotations

import json
import re
import warnings

import pytest
import torch
from typer.testing import CliRunner

from adapters.test_slime_config import args, call_policy
from nemo_is_plugin.adapters.nemo_rl import NeMoRLLossFn
from nemo_is_plugin.adapters.slime.config import plugin_keys, policy_config
from nemo_is_plugin.adapters.verl.config import preset_keys
from nemo_is_plugin.adapters.verl.policy_loss import _user_keys
from nemo_is_plugin.config import ConfigError, UnknownConfigKeyWarning
from nemo_is_plugin.loss.config_model import ClippedPGLossConfig

PRESET = "decoupled_k3_rs_token_tis"  # token TIS at 2 and a k3 sequence-mean rejection at 0.01
ENTRY = {"preset": "decoupled_geo_rs_seq_tis", "is_threshold": 3.0}


def _dump(keys) -> dict:
    return ClippedPGLossConfig(**keys).model_dump()


@pytest.mark.parametrize("entry", [PRESET, ENTRY], ids=["preset", "preset-with-keyword"])
def test_verls_rollout_correction_is_applied_alike_in_every_host(entry):
    want = preset_keys(entry) if isinstance(entry, str) else preset_keys(entry["preset"], is_threshold=3.0)
    section = {"rollout_correction": entry}
    assert NeMoRLLossFn(section).config.model_dump() == _dump(want)
    assert _user_keys(section, "loss_fn") == want  # verl's plugin section
    assert plugin_keys(args(nemo_is=section), "policy_loss") == want  # slime's
    on = policy_config(args(), plugin_keys(args(nemo_is=section), "policy_loss"))
    assert on.use_importance_sampling_correction and on.rejection_rules


def test_the_sections_own_keys_win_over_the_preset():
    section = {"rollout_correction": PRESET, "truncated_importance_sampling_ratio": 3.0}
    assert NeMoRLLossFn(section).config.truncated_importance_sampling_ratio == 3.0
    assert plugin_keys(args(nemo_is=section), "policy_loss")["truncated_importance_sampling_ratio"] == 3.0


def test_slimes_loss_with_the_preset_is_its_loss_with_the_presets_keys():
    """The whole slime loss (value and gradient) with ``rollout_correction: <preset>`` equals it with the preset's
    plugin keys written out, and differs from slime's uncorrected loss (what the key gave before: it was ignored)."""
    got = call_policy(args(nemo_is={"rollout_correction": PRESET}))
    written = call_policy(args(nemo_is=preset_keys(PRESET)))
    plain = call_policy(args(nemo_is={}))
    for a, b in zip(got, written, strict=True):
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b)
    assert not torch.equal(got[0], plain[0])


@pytest.mark.parametrize(
    "key, nemo_rl, verl, slime",
    [
        ("clip_ratio_low", "ratio_clip_min", "actor_rollout_ref.actor.clip_ratio_low", "--eps-clip"),
        ("clip_ratio_high", "ratio_clip_max", "actor_rollout_ref.actor.clip_ratio_high", "--eps-clip-high"),
        ("loss_agg_mode", "loss_aggregation", "actor_rollout_ref.actor.loss_agg_mode", "--calculate-per-token-loss"),
    ],
)
def test_a_verl_actor_key_in_a_plugin_section_is_refused_naming_the_hosts_own_key(key, nemo_rl, verl, slime):
    section = {key: 0.3 if "clip" in key else "token-mean"}
    with pytest.raises(ConfigError, match=f"loss_fn.{key} is verl's actor key.*: set {nemo_rl}"):
        NeMoRLLossFn(section)
    with pytest.raises(ConfigError, match=f"policy_loss.nemo_is.{key} is verl's actor key.*: set {verl}"):
        _user_keys({"loss_fn": section}, "loss_fn")
    with pytest.raises(ConfigError, match=f"nemo_is.{key} is verl's actor key.*: set {slime}"):
        plugin_keys(args(nemo_is=section), "policy_loss")


@pytest.mark.parametrize(
    "build, says",
    [
        (lambda s: NeMoRLLossFn(s), r"unknown loss_fn key.*'is_corection_level'.*\(NeMo-RL accepts extra keys\)"),
        (lambda s: _user_keys({"loss_fn": s}, "loss_fn"), r"unknown actor_rollout_ref.*nemo_is key.*\(verl hands"),
        (lambda s: plugin_keys(args(nemo_is=s), "policy_loss"), r"unknown nemo_is key.*\(slime hands args.nemo_is"),
    ],
    ids=["NeMo-RL", "verl", "slime"],
)
def test_each_hosts_unknown_key_warning_names_that_host(build, says):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        build({"is_corection_level": "sequence"})
    (warning,) = [w for w in caught if w.category is UnknownConfigKeyWarning]
    assert "did you mean 'is_correction_level'" in str(warning.message)
    assert re.search(says, str(warning.message)), str(warning.message)


def test_the_config_itself_refuses_rollout_correction_rather_than_ignore_it():
    with pytest.raises(ConfigError, match="verl's rollout_correction .* build through an adapter"):
        ClippedPGLossConfig(rollout_correction=PRESET)


def test_nemo_is_validate_applies_the_preset(tmp_path):
    from nemo_is_plugin.apps.cli.main import app

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"loss_fn:\n  rollout_correction: {PRESET}\n")
    shown = CliRunner().invoke(app, ["validate", str(recipe), "--json"])
    assert shown.exit_code == 0, shown.output
    report = json.loads(shown.stdout)
    assert report["valid"] is True and report["ignored_keys"] is None
    assert {k: report["config"][k] for k in preset_keys(PRESET)} == ClippedPGLossConfig(
        **preset_keys(PRESET)
    ).model_dump(include=set(preset_keys(PRESET)))
