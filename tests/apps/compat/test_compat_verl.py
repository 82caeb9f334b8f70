"""``nemo-is compat --host verl`` against verl 0.9.1 itself (its policy-loss registry and rollout_corr_helper):
parity with and without verl's rollout correction, for ``vanilla`` and for every other loss mode the verl adapter
maps, what plugin keys change, a perturbed loss of each mode caught, the documented setting verl forces, and the
configs it refuses. Needs verl (the ``verl`` extra; CI installs it); skipped only if verl does not import."""

from __future__ import annotations

import json
import sys

import pytest
from typer.testing import CliRunner

core_algos = pytest.importorskip(
    "verl.trainer.ppo.core_algos",
    reason="verl is not importable: pip install 'nemo-is-plugin[verl]' (see docs/verl.md)",
)

from nemo_is_plugin.apps.cli.main import app  # noqa: E402
from nemo_is_plugin.apps.compat.compare import AGREES, CHANGED, DIFFERS  # noqa: E402

runner = CliRunner()

VERL = """\
actor_rollout_ref:
  actor:
    clip_ratio_low: 0.2
    clip_ratio_high: 0.28
    clip_ratio_c: 3.0
    loss_agg_mode: {agg}
    policy_loss:
      loss_mode: vanilla
algorithm:
  rollout_correction:
    rollout_is: {level}
    rollout_is_threshold: {threshold}
    rollout_rs: {rs}
    rollout_rs_threshold: {rs_threshold}
"""


def verl_config(agg="token-mean", level="token", threshold="2.0", rs="null", rs_threshold="null", extra="") -> str:
    return VERL.format(agg=agg, level=level, threshold=threshold, rs=rs, rs_threshold=rs_threshold) + extra


def compat(tmp_path, text: str, *args: str):
    config = tmp_path / "config.yaml"
    config.write_text(text)
    out = tmp_path / "report.json"
    out.unlink(missing_ok=True)
    result = runner.invoke(app, ["compat", str(config), "--host", "verl", "--json", str(out), *args])
    report = json.loads(out.read_text()) if out.exists() else None
    return result.exit_code, report, result.output


def by_output(findings: list[dict]) -> dict[str, dict]:
    return {f["output"]: f for f in findings}


VERL_METRICS = ("metric actor/pg_clipfrac", "metric actor/pg_clipfrac_lower", "metric actor/ppo_kl")


@pytest.mark.parametrize(
    "settings",
    [
        dict(level="null"),
        dict(level="token"),
        dict(level="sequence", threshold="1.5", agg="seq-mean-token-mean"),
        dict(level="token", threshold="'0.8_1.25'", rs="seq_mean_k3", rs_threshold="0.01", agg="seq-mean-token-sum"),
    ],
    ids=["no_correction", "token_tis", "sequence_tis", "icepop_k3_rs"],
)
def test_verl_settings_agree_with_verls_vanilla(tmp_path, settings):
    code, report, output = compat(tmp_path, verl_config(**settings))
    assert code == 0, output
    parity = by_output(report["parity"])
    for name in ("loss", "gradient", *VERL_METRICS):
        assert parity[name]["status"] == AGREES, (name, parity[name])
    assert report["plugin_keys"] == {}


def test_plugin_keys_report_what_they_change(tmp_path):
    section = """\
      loss_mode: nemo_is.clipped_pg
      nemo_is:
        reference_policy_kl_penalty: 0.0
        use_importance_sampling_correction: true
        is_correction_level: sequence_mean
"""
    text = verl_config(threshold="1.0e9").replace("      loss_mode: vanilla\n", section)
    code, report, output = compat(tmp_path, text)
    assert code == 0, output
    assert all(f["status"] != DIFFERS for f in report["parity"])
    changes = by_output(report["changes"])
    assert {"loss", "gradient"} <= set(changes)
    for found in changes.values():
        assert found["status"] == CHANGED and found["notes"][0].startswith("changed by "), found
    # the IS weights move to the sequence level; the PPO ratio's metrics do not
    assert "is_correction_level" in changes["loss"]["notes"][0]
    assert set(report["unchanged"]) >= set(VERL_METRICS)


def test_a_vanilla_scaled_by_1_001_is_caught(tmp_path, monkeypatch):
    vanilla = core_algos.get_policy_loss_fn("vanilla")

    def scaled(*args, **kwargs):
        loss, metrics = vanilla(*args, **kwargs)
        return loss * 1.001, metrics

    monkeypatch.setitem(core_algos.POLICY_LOSS_REGISTRY, "vanilla", scaled)
    code, report, output = compat(tmp_path, verl_config())
    assert code == 1
    parity = by_output(report["parity"])
    assert parity["loss"]["status"] == DIFFERS and parity["gradient"]["status"] == DIFFERS
    assert all(parity[m]["status"] == AGREES for m in VERL_METRICS)
    assert "loss" in report["verdict"] and "DIFFERS" in output


def test_a_dropped_verl_metric_is_caught(tmp_path, monkeypatch):
    from nemo_is_plugin.adapters.verl import VerlPolicyLoss

    call = VerlPolicyLoss.__call__

    def dropping(self, *args, **kwargs):
        loss, metrics = call(self, *args, **kwargs)
        return loss, {k: v for k, v in metrics.items() if k != "actor/ppo_kl"}

    monkeypatch.setattr(VerlPolicyLoss, "__call__", dropping)
    code, report, _ = compat(tmp_path, verl_config())
    assert code == 1
    assert by_output(report["parity"])["metric actor/ppo_kl"]["notes"] == ["not reported by the plugin"]


def test_configs_compat_cannot_compare_exit_2_with_the_reason(tmp_path):
    code, _, output = compat(tmp_path, verl_config(extra="    bypass_mode: true\n"))
    assert code == 2 and "apply_bypass_mode" in output
    code, _, output = compat(tmp_path, verl_config(extra="    score_centering: true\n"))
    assert code == 2 and "score_centering=true" in output and "apply_bypass_mode" in output
    code, _, output = compat(tmp_path, verl_config(extra="    rollout_token_veto_threshold: 1.0e-4\n"))
    assert code == 2 and "rollout_token_veto_threshold" in output
    # a file verl reads nothing from (here a NeMo-RL loss_fn section) would only compare verl's defaults
    code, _, output = compat(tmp_path, "loss_fn:\n  ratio_level: cumulative\n")
    assert code == 2 and "not a verl trainer config" in output and "--host nemo-rl" in output


def test_without_verl_installed_one_line_names_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "verl.trainer.ppo.core_algos", None)
    code, report, output = compat(tmp_path, verl_config())
    assert code == 2 and report is None
    assert output.strip().count("\n") == 0
    assert "verl is not importable here" in output and "nemo-is-plugin[verl]" in output


# ---------------------------------------------------------------------------------------------------------------------
# verl's other loss modes: verl's own function for the mode against the plugin's mapping of it
# ---------------------------------------------------------------------------------------------------------------------

from nemo_is_plugin.adapters.verl.loss_modes import (  # noqa: E402
    FORCED_AGGREGATION,
    REFUSED_LOSS_MODES,
    VERL_LOSS_MODES,
)
from nemo_is_plugin.apps.compat.compare import DELIBERATE  # noqa: E402

MODE = """\
actor_rollout_ref:
  actor:
{actor}    loss_agg_mode: {agg}
    policy_loss:
      loss_mode: {mode}
{policy_loss}algorithm:
  rollout_correction:
    rollout_is: {level}
    rollout_is_threshold: 2.0
"""
# Per mode: (actor settings, policy_loss settings), chosen so that each mode's trust region acts on the batches.
MODE_SETTINGS = {
    "vanilla": ({"clip_ratio_low": 0.2, "clip_ratio_high": 0.28}, {}),
    "gspo": ({"clip_ratio_low": 3.0e-4, "clip_ratio_high": 4.0e-4}, {}),
    "cispo": ({"clip_ratio_low": 0.1, "clip_ratio_high": 0.15}, {}),
    "dppo_tv": ({"clip_ratio_low": 0.1, "clip_ratio_high": 0.15, "clip_ratio_c": 5.0}, {}),
    "dppo_kl": ({"clip_ratio_low": 0.03, "clip_ratio_high": 0.05, "clip_ratio_c": 20.0}, {}),
    "sapo": ({"tau_pos": 0.8, "tau_neg": 1.2}, {}),
    "geo_mean": ({"clip_ratio_low": 0.3, "clip_ratio_high": 0.4}, {}),
    "gpg": ({}, {}),
    "dro": ({}, {"dro_beta": 0.05}),
}
CLIPPING_MODES = ("vanilla", "gspo", "cispo", "dppo_tv", "dppo_kl", "geo_mean")  # verl reports pg_clipfrac > 0


def mode_config(mode: str, level: str = "token", agg: str | None = None, loss_mode: str | None = None) -> str:
    actor, policy_loss = MODE_SETTINGS[mode]
    lines = lambda keys, indent: "".join(f"{indent}{k}: {v}\n" for k, v in keys.items())  # noqa: E731
    return MODE.format(
        actor=lines(actor, "    "),
        agg=agg or FORCED_AGGREGATION.get(mode, "token-mean"),
        mode=loss_mode or mode,
        policy_loss=lines(policy_loss, "      "),
        level=level,
    )


def test_every_mapped_mode_has_a_config_here():
    assert set(MODE_SETTINGS) == set(VERL_LOSS_MODES)


@pytest.mark.parametrize("level", ["null", "token"], ids=["no_correction", "token_tis"])
@pytest.mark.parametrize("mode", VERL_LOSS_MODES)
def test_each_mapped_loss_mode_agrees_with_verls_own(tmp_path, mode, level):
    code, report, output = compat(tmp_path, mode_config(mode, level))
    assert code == 0, output
    assert report["host_keys"]["policy_loss.loss_mode"] == mode and report["plugin_keys"] == {}
    parity = by_output(report["parity"])
    host_metrics = [name for name, f in parity.items() if name.startswith("metric ") and f["status"] != "plugin only"]
    assert {"loss", "gradient"} <= set(parity)
    for name in ("loss", "gradient", *host_metrics):
        assert parity[name]["status"] == AGREES, (name, parity[name])
    assert not any(name.startswith("setting ") for name in parity)


@pytest.mark.parametrize("mode", CLIPPING_MODES)
def test_the_modes_trust_region_acts_on_the_batches(tmp_path, mode):
    """Non-vacuity: verl's own loss clips on the compared batches, so the mapping of its bounds is exercised."""
    from nemo_is_plugin.apps.compat import load_host
    from nemo_is_plugin.apps.compat.batches import synthetic_batch

    config = tmp_path / "config.yaml"
    config.write_text(mode_config(mode))
    run = load_host("verl", config).run_host(synthetic_batch(0))
    assert 0.0 < run.metrics["actor/pg_clipfrac"] < 1.0, run.metrics


@pytest.mark.parametrize("mode", VERL_LOSS_MODES)
def test_a_modes_loss_scaled_by_1_001_is_caught(tmp_path, monkeypatch, mode):
    own = core_algos.get_policy_loss_fn(mode)

    def scaled(*args, **kwargs):
        loss, metrics = own(*args, **kwargs)
        return loss * 1.001, metrics

    monkeypatch.setitem(core_algos.POLICY_LOSS_REGISTRY, mode, scaled)
    code, report, output = compat(tmp_path, mode_config(mode))
    assert code == 1, output
    parity = by_output(report["parity"])
    assert parity["loss"]["status"] == DIFFERS and parity["gradient"]["status"] == DIFFERS
    assert all(f["status"] != DIFFERS for name, f in parity.items() if name.startswith("metric "))
    assert "loss" in report["verdict"] and "DIFFERS" in output


def test_the_plugin_selected_mode_is_the_sections(tmp_path):
    """``loss_mode: nemo_is.clipped_pg`` with ``nemo_is.loss_mode: dppo_tv``: the host is verl's dppo_tv, and a plugin
    key of the section is reported as what it changes."""
    section = "      nemo_is:\n        loss_mode: dppo_tv\n        dppo_ratio_cap: 1.05\n"
    text = mode_config("dppo_tv", loss_mode="nemo_is.clipped_pg").replace("algorithm:", section + "algorithm:")
    code, report, output = compat(tmp_path, text)
    assert code == 0, output
    assert report["host_keys"]["policy_loss.loss_mode"] == "dppo_tv"
    assert report["plugin_keys"] == {"dppo_ratio_cap": 1.05}
    assert all(f["status"] == AGREES for f in report["parity"] if f["output"] in ("loss", "gradient"))
    assert "dppo_ratio_cap" in by_output(report["changes"])["loss"]["notes"][0]


@pytest.mark.parametrize("mode", sorted(FORCED_AGGREGATION))
def test_the_aggregation_verl_forces_is_a_documented_setting(tmp_path, mode):
    code, report, output = compat(tmp_path, mode_config(mode, agg="token-mean"))
    assert code == 0, output
    parity = by_output(report["parity"])
    setting = parity["setting actor.loss_agg_mode"]
    assert setting["status"] == DELIBERATE and FORCED_AGGREGATION[mode] in setting["notes"][0]
    assert parity["loss"]["status"] == AGREES and parity["gradient"]["status"] == AGREES
    code, report, output = compat(tmp_path, mode_config(mode, agg="token-mean"), "--strict")
    assert code == 1 and "setting actor.loss_agg_mode" in report["verdict"]
    # selected through the plugin, the plugin refuses the setting as it would refuse the run
    text = mode_config(mode, agg="token-mean", loss_mode="nemo_is.clipped_pg").replace(
        "algorithm:", f"      nemo_is:\n        loss_mode: {mode}\nalgorithm:"
    )
    code, _, output = compat(tmp_path, text)
    assert code == 2 and FORCED_AGGREGATION[mode] in output


@pytest.mark.parametrize("mode", [*sorted(REFUSED_LOSS_MODES), "bypass_mode", "no_such_mode"])
@pytest.mark.parametrize("selected_by", ["verl", "plugin section"])
def test_a_refused_mode_exits_2_with_one_line_why(tmp_path, mode, selected_by):
    text = mode_config("vanilla", loss_mode=mode)
    if selected_by == "plugin section":
        text = mode_config("vanilla", loss_mode="nemo_is.clipped_pg").replace(
            "algorithm:", f"      nemo_is:\n        loss_mode: {mode}\nalgorithm:"
        )
    code, report, output = compat(tmp_path, text)
    assert code == 2 and report is None
    assert output.strip().count("\n") == 0, output
    reason = {
        "clip_cov": REFUSED_LOSS_MODES.get("clip_cov", ""),
        "kl_cov": REFUSED_LOSS_MODES.get("kl_cov", ""),
        "bypass_mode": "apply_bypass_mode",
        "no_such_mode": "compat compares the verl losses the plugin maps",
    }[mode]
    assert f"loss_mode={mode!r}" in output
    assert " ".join(reason.split())[:60] in " ".join(output.split()), output
