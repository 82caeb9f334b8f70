"""``nemo-is validate``: the verdict line (defaults said explicitly), --json, --show-effective, and one behaviour with
nemo_is_plugin.build_loss_fn and the NeMo-RL adapter's build_nemo_rl_loss_fn for the same loss_fn section."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from omegaconf import OmegaConf
from typer.testing import CliRunner

import nemo_is_plugin
from nemo_is_plugin.adapters import nemo_rl
from nemo_is_plugin.apps.cli.main import app
from nemo_is_plugin.config import ConfigError
from nemo_is_plugin.loss.config_model import ClippedPGLossConfig
from nemo_is_plugin.loss.effective import effective_settings

ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = ROOT / "configs" / "examples" / "nemo_rl_grpo_tis.yaml"


def _validate(*args: str):
    return CliRunner().invoke(app, ["validate", *map(str, args)], env={"COLUMNS": "200"})


@pytest.mark.parametrize(
    "text, where",
    [
        ("", "the file is empty"),
        ("loss_fn:\n", "the 'loss_fn' section is empty"),
        ("policy: {a: 1}\nloss_fn: {}\n", "the 'loss_fn' section is empty"),
    ],
)
def test_an_empty_recipe_says_defaults_explicitly(tmp_path, text, where):
    path = tmp_path / "r.yaml"
    path.write_text(text)
    result = _validate(path)
    assert result.exit_code == 0, result.output
    assert f"{where}: every key takes its default" in result.output


@pytest.mark.parametrize(
    "switches, said",
    [
        (
            "use_cispo: true\n  ratio_clip_min: 1.0\n  ratio_clip_max: 5.0",
            "cispo (selected by NeMo-RL's use_cispo: true)",
        ),
        ("disable_ppo_ratio: true", "reinforce (selected by NeMo-RL's disable_ppo_ratio: true)"),
        (
            "force_on_policy_ratio: true\n  disable_ppo_ratio: true",
            "on_policy (selected by NeMo-RL's force_on_policy_ratio",
        ),
        ("policy_objective: reinforce", "reinforce (policy_objective)"),
    ],
)
def test_show_effective_names_the_objective_nemo_rl_s_switches_select(tmp_path, switches, said):
    path = tmp_path / "r.yaml"
    path.write_text(f"loss_fn:\n  {switches}\n")
    result = _validate(path, "--show-effective")
    assert result.exit_code == 0, result.output
    row = next(line for line in result.output.splitlines() if "policy objective" in line)
    assert said in row, result.output


def test_only_defaults_given_is_said_too(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("loss_fn:\n  ratio_clip_min: 0.2\n")
    result = _validate(path)
    assert result.exit_code == 0 and "every key it sets equals its default" in result.output


def test_json_output_is_one_parseable_object_with_the_loss_and_settings():
    result = _validate(
        ROOT / "configs" / "geo_rs_tis.yaml",
        "--json",
        "--batch-size",
        "4",
        "--seq-len",
        "32",
        "--mismatch-std",
        "0.0001",
    )
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["valid"] is True and report["name"] == "nemo_is.clipped_pg" and report["defaults"] is None
    assert report["changed"]["importance_sampling_rejection"] == "geo-rs"
    assert report["config"] == ClippedPGLossConfig(**report["changed"]).model_dump()
    assert report["effective"]["IS rejection"].startswith("geo-rs outside [0.999, 1.001]")
    assert isinstance(report["loss"], float) and report["grad_norm"] > 0
    assert 0 < report["metrics"]["is_weight_ess"] <= 1


def test_json_error_is_an_object_too_with_exit_2(tmp_path):
    result = _validate(ROOT / "configs" / "geo_rs_tis.yaml", "--json", "-o", "ratio_clip_max=0.3")
    assert result.exit_code == 2
    report = json.loads(result.output)
    assert report["valid"] is False and "did you mean 'loss_fn.ratio_clip_max'" in report["error"]


def test_show_effective_prints_every_resolved_choice_and_every_key():
    result = _validate(ROOT / "configs" / "gspo_sequence_mean_tis.yaml", "--show-effective")
    assert result.exit_code == 0, result.output
    out = result.output
    assert "sequence (from sequence_level_importance_ratios=true)" in out
    assert "sequence_mean (is_correction_level" in out and "tis: clamp the weight to [0, 2]" in out
    assert "off (reference_policy_kl_penalty = 0" in out
    assert "seq-mean-token-mean (from token_level_loss=False" in out
    for key in ClippedPGLossConfig.model_fields:
        assert key in out


@pytest.mark.parametrize(
    "kwargs, key, expected",
    [
        ({}, "policy ratio", "token (NeMo-RL default)"),
        (
            {},
            "KL to the reference",
            "k3, beta 0.01, clamps input +-20, output +-10, weight exp(c - sg[c]), gradient the estimator's own",
        ),
        ({"use_kl_in_reward": True}, "KL to the reference", "in the reward"),
        ({"disable_ppo_ratio": True}, "policy ratio", "none: REINFORCE"),
        (
            {"use_cispo": True, "ratio_clip_min": 1.0, "ratio_clip_max": 5.0},
            "ratio clip",
            "CISPO: stop-gradient weight clamp(r, 0, 6)",
        ),
        ({"ratio_clip_c": 3.0}, "ratio clip", "ratio space [0.8, 1.2], dual clip c = 3"),
        (
            {"loss_aggregation": "seq-mean-token-sum-norm", "loss_aggregation_norm": 512.0},
            "aggregation",
            "seq-mean-token-sum-norm (loss_aggregation, divisor 512",
        ),
        ({"importance_sampling_veto_threshold": 1e-4}, "IS rejection", "veto a sequence with a token weight < 0.0001"),
        (
            {
                "importance_sampling_rejection_rules": [
                    {"statistic": "prob_diff", "aggregation": "sequence_max", "max": 0.2},
                    {"option": "token_k1", "threshold": "0.5_2"},
                ]
            },
            "IS rejection",
            "rule sequence_max_prob_diff: keep while |pi_prev - mu| <= 0.2; rule token_k1: keep while -0.693147 <= k1 "
            "<= 0.693147",
        ),
        (
            {
                "use_importance_sampling_correction": True,
                "truncated_importance_sampling_type": "icepop",
                "truncated_importance_sampling_ratio": 5.0,
                "truncated_importance_sampling_ratio_min": 0.5,
            },
            "IS truncation",
            "icepop: zero token weights outside [0.5, 5]",
        ),
    ],
)
def test_effective_settings(kwargs, key, expected):
    assert effective_settings(ClippedPGLossConfig(**kwargs))[key].startswith(expected)


# ------------------------------------------------------------------ one behaviour for a loss_fn section everywhere
def _three_ways(section: dict, tmp_path: Path) -> list[bool]:
    """Whether nemo_is_plugin.build_loss_fn, the NeMo-RL adapter's build_nemo_rl_loss_fn and `nemo-is validate`
    accept."""
    accepted = []
    for build in (nemo_is_plugin.build_loss_fn, nemo_rl.build_nemo_rl_loss_fn):
        try:
            build(section)
            accepted.append(True)
        except ValueError:  # a ConfigError or pydantic's ValidationError
            accepted.append(False)
    path = tmp_path / "section.yaml"
    path.write_text(OmegaConf.to_yaml({"loss_fn": section}))
    result = _validate(path, "--batch-size", "2", "--seq-len", "16")
    assert result.exit_code in (0, 2), result.output
    accepted.append(result.exit_code == 0)
    return accepted


def test_the_example_section_with_its_name_is_accepted_by_all_three(tmp_path):
    section = OmegaConf.to_container(OmegaConf.load(EXAMPLE)["loss_fn"])
    assert section["name"] == "nemo_is.clipped_pg"
    assert _three_ways(section, tmp_path) == [True, True, True]
    # the reported call: nemo_is_plugin.build_loss_fn(yaml['loss_fn']) with the OmegaConf node itself
    loss = nemo_is_plugin.build_loss_fn(OmegaConf.load(EXAMPLE)["loss_fn"])
    assert loss.config.truncated_importance_sampling_ratio == 2.0


@pytest.mark.parametrize(
    "section",
    [{"name": "nemo_is.clipped"}, {"ratio_clip_max": -0.5}, {"name": "nemo_is.clipped_pg", "ratio_clip_min": 1.5}],
)
def test_a_bad_section_is_refused_by_all_three(tmp_path, section):
    assert _three_ways(section, tmp_path) == [False, False, False]


def test_a_name_registered_to_another_loss_builds_that_loss_and_the_clipped_loss_refuses_it(monkeypatch):
    from nemo_is_plugin.loss import ClippedPGLoss
    from nemo_is_plugin.loss.registry import LOSSES

    monkeypatch.setitem(LOSSES, "tests.other_loss", lambda config: ("other", config))
    assert nemo_is_plugin.build_loss_fn({"name": "tests.other_loss", "a": 1}) == ("other", {"a": 1})
    with pytest.raises(ConfigError, match="registered to .* not ClippedPGLoss"):
        ClippedPGLoss({"name": "tests.other_loss"})


def test_a_misspelled_key_fails_with_the_did_you_mean_in_one_line(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("loss_fn:\n  is_correction_levl: token\n")
    result = CliRunner().invoke(app, ["validate", str(path)])  # 80 columns: the line is not broken
    assert result.exit_code == 2
    (line,) = result.output.strip().splitlines()
    assert line.startswith(f"invalid recipe {path}: unknown loss_fn key(s): 'is_correction_levl'")
    assert "(did you mean 'is_correction_level'?)" in line and "--allow-unknown-keys" in line
    assert "Warning" not in result.output


def test_allow_unknown_keys_lists_them_and_validates_the_rest(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("loss_fn:\n  is_correction_levl: token\n  ratio_clip_max: 0.28\n")
    result = _validate(path, "--allow-unknown-keys")
    assert result.exit_code == 0, result.output
    first, second = result.output.splitlines()[:2]
    assert first.startswith("ignored unknown loss_fn key(s): 'is_correction_levl' (did you mean")
    assert second == f"valid {path} (loss nemo_is.clipped_pg): ratio_clip_max=0.28"
    report = json.loads(_validate(path, "--allow-unknown-keys", "--json").output)
    assert report["valid"] and "is_correction_levl" in report["ignored_keys"]
    assert json.loads(_validate(path, "--json").output)["valid"] is False


def test_the_loss_itself_still_only_warns(tmp_path):
    """NeMo-RL's config has extra="allow": building the loss from the same section warns and runs."""
    from nemo_is_plugin.config import UnknownConfigKeyWarning

    with pytest.warns(UnknownConfigKeyWarning, match="did you mean 'is_correction_level'"):
        nemo_is_plugin.build_loss_fn({"is_correction_levl": "token"})


def test_pydantic_bad_value_is_shown_and_the_path_once(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("loss_fn:\n  ratio_clip_max: -1\n")
    result = _validate(path)
    assert result.exit_code == 2
    assert "[type=value_error, input_value=-1, input_type=int]" in result.output  # not swallowed as rich markup
    assert result.output.count(str(path)) == 1 and result.output.startswith(f"invalid recipe: {path}: invalid")


def test_score_centering_runs_on_a_synthetic_head_and_a_master_configs_sampling_is_checked(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("loss_fn:\n  score_centering: true\n  score_centering_top_k: 4\n")
    result = _validate(path, "--json")
    assert result.exit_code == 0, result.output
    metrics = json.loads(result.output)["metrics"]
    # the synthetic head holds 0.9 of each distribution: tails 0.1 (to float32 rounding), so rho = 1
    assert metrics["score_centering_sampler_tail"] == pytest.approx(0.1, abs=1e-5)
    assert metrics["score_centering_tail_ratio"] == pytest.approx(1.0, abs=1e-3)
    master = tmp_path / "m.yaml"
    master.write_text(
        "policy:\n  generation: {backend: vllm, temperature: 1.0, top_p: 0.95, top_k: null, vllm_cfg: {}}\n"
        "loss_fn:\n  score_centering: true\n"
    )
    result = CliRunner().invoke(app, ["validate", str(master)])
    assert result.exit_code == 2
    assert "policy.generation.top_p=0.95: score centering needs the head" in result.output
