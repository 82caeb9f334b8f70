"""``nemo-is compat --host verl`` against verl 0.9.1 itself (its policy-loss registry and rollout_corr_helper):
parity with and without verl's rollout correction, what plugin keys change, a perturbed ``vanilla`` caught, and the
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

from nemo_is_plugin.cli.main import app  # noqa: E402
from nemo_is_plugin.compat.compare import AGREES, CHANGED, DIFFERS  # noqa: E402

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
    code, _, output = compat(tmp_path, verl_config().replace("loss_mode: vanilla", "loss_mode: gspo"))
    assert code == 2 and "loss_mode='gspo'" in output
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
