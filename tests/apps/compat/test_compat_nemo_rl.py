"""``nemo-is compat --host nemo-rl`` against the fake installed NeMo-RL (conftest.py): parity on NeMo-RL's configs,
the documented NaN-gradient difference, what a plugin key changes, a perturbed host caught, and the refusals."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from typer.testing import CliRunner

from nemo_is_plugin.apps.cli.main import app
from nemo_is_plugin.apps.compat.compare import AGREES, CHANGED, DELIBERATE, DIFFERS

runner = CliRunner()

MASTER = """\
grpo:
  num_prompts_per_step: 32
policy:
  max_total_sequence_length: 512
loss_fn:
  reference_policy_kl_penalty: 0.01
  ratio_clip_min: 0.2
  ratio_clip_max: 0.28
  use_importance_sampling_correction: true
  truncated_importance_sampling_type: tis
  truncated_importance_sampling_ratio: 2.0
"""


def compat(tmp_path, text: str, *args: str):
    """Run the command on a master config (written to a file); returns (exit code, JSON report or None, output)."""
    config = tmp_path / "grpo.yaml"
    config.write_text(text)
    out = tmp_path / "report.json"
    result = runner.invoke(app, ["compat", str(config), "--json", str(out), *args])
    report = json.loads(out.read_text()) if out.exists() else None
    return result.exit_code, report, result.output


def by_output(findings: list[dict]) -> dict[str, dict]:
    return {f["output"]: f for f in findings}


def test_nemo_rl_config_agrees_on_loss_gradient_and_every_host_metric(fake_nemo_rl, tmp_path):
    code, report, output = compat(tmp_path, MASTER)
    assert code == 0, output
    assert report["agrees"] and report["plugin_keys"] == {}
    assert report["host_keys"]["truncated_importance_sampling_ratio"] == 2.0
    parity = by_output(report["parity"])
    # every metric NeMo-RL's loss reports is compared, the IS metrics of TIS included
    for name in (
        "loss",
        "gradient",
        "metric sampling_importance_ratio",
        "metric is_oob_ratio",
        "metric kl_penalty",
        "metric probs_ratio_max",
        "metric token_mult_prob_error",
    ):
        assert parity[name]["status"] == AGREES, (name, parity[name])
    assert "metric is_weight_mean" not in parity or parity["metric is_weight_mean"]["status"] == "plugin only"
    assert len(report["batches"]) == 4
    assert "AGREES" in output and "sampling_importance_ratio" in output


def test_defaults_inheritance_and_overrides_are_read_as_nemo_rl_does(fake_nemo_rl, tmp_path):
    (tmp_path / "base.yaml").write_text(MASTER)
    code, report, output = compat(
        tmp_path, "defaults: base.yaml\nloss_fn:\n  ratio_clip_max: 0.3\n", "-o", "loss_fn.reference_policy_kl_type=k2"
    )
    assert code == 0, output
    assert report["host_keys"]["ratio_clip_max"] == 0.3
    assert report["host_keys"]["reference_policy_kl_type"] == "k2"
    assert report["host_keys"]["truncated_importance_sampling_type"] == "tis"


def with_nemo_rl_kl_backward(module, monkeypatch):
    """NeMo-RL's own backward of its on-policy KL weight ``nan_to_num(exp(c - g))``: 0 * inf = NaN at a -inf
    generation log-prob. (The model re-derives the value NeMo-RL computes with the plugin's gradient, see
    tests/test_nemo_rl_differential.py; this adds NeMo-RL's literal term, whose forward value is 0.)"""
    call = module.ClippedPGLossFn.__call__

    def literal(self, next_token_logprobs, data, global_valid_seqs, global_valid_toks):
        loss, metrics = call(self, next_token_logprobs, data, global_valid_seqs, global_valid_toks)
        weight = torch.nan_to_num(torch.exp(next_token_logprobs - data["generation_logprobs"][:, 1:]))
        return loss + 0.0 * (weight * data["token_mask"][:, 1:]).sum(), metrics

    monkeypatch.setattr(module.ClippedPGLossFn, "__call__", literal)


def test_nan_gradient_of_on_policy_kl_at_minus_inf_is_the_documented_difference(fake_nemo_rl, tmp_path, monkeypatch):
    with_nemo_rl_kl_backward(fake_nemo_rl, monkeypatch)
    text = MASTER + "  use_on_policy_kl_approximation: true\n"
    code, report, output = compat(tmp_path, text)
    grad = by_output(report["parity"])["gradient"]
    assert grad["status"] == DELIBERATE and "NaN gradients" in grad["notes"][0], grad
    assert code == 0, output
    assert by_output(report["parity"])["loss"]["status"] == AGREES
    code, report, _ = compat(tmp_path, text, "--strict")
    assert code == 1 and not report["agrees"]
    # without the on-policy KL, a NaN gradient is no documented difference
    code, report, _ = compat(tmp_path, MASTER)
    assert code == 1 and by_output(report["parity"])["gradient"]["status"] == DIFFERS


def test_a_plugin_key_reports_what_it_changes_and_nothing_else(fake_nemo_rl, tmp_path):
    code, report, output = compat(tmp_path, MASTER + "  is_correction_level: sequence_mean\n")
    assert code == 0, output
    assert report["plugin_keys"] == {"is_correction_level": "sequence_mean"}
    assert all(f["status"] != DIFFERS for f in report["parity"])
    changes = by_output(report["changes"])
    # the IS weight changes level: the loss, its gradient and the IS metrics move, nothing else does
    assert {"loss", "gradient", "metric sampling_importance_ratio"} <= set(changes), sorted(changes)
    for found in changes.values():
        assert found["status"] == CHANGED and found["notes"] == ["changed by is_correction_level"], found
    for name in ("metric probs_ratio", "metric probs_ratio_clamped", "metric kl_penalty", "metric gen_kl_error"):
        assert name in report["unchanged"], name
    assert "changed by is_correction_level" in output
    # each changed row shows both values at its worst batch, not only the size of their difference
    for name in ("loss", "metric sampling_importance_ratio"):
        row = changes[name]
        assert abs(row["plugin_value"] - row["host_value"]) == pytest.approx(row["abs_diff"], rel=1e-12)
        assert f"{row['host_value']:.4g} -> {row['plugin_value']:.4g}" in output
    assert changes["gradient"]["host_value"] > 0 and changes["gradient"]["plugin_value"] > 0  # the norms


def test_a_host_scaled_by_1_001_is_caught(fake_nemo_rl, tmp_path, monkeypatch):
    call = fake_nemo_rl.ClippedPGLossFn.__call__

    def scaled(self, *args, **kwargs):
        loss, metrics = call(self, *args, **kwargs)
        return loss * 1.001, metrics

    monkeypatch.setattr(fake_nemo_rl.ClippedPGLossFn, "__call__", scaled)
    code, report, output = compat(tmp_path, MASTER)
    assert code == 1
    parity = by_output(report["parity"])
    assert parity["loss"]["status"] == DIFFERS and parity["gradient"]["status"] == DIFFERS
    assert parity["loss"]["rel_diff"] == pytest.approx(1e-3 / 1.001, rel=1e-3)
    assert parity["metric probs_ratio"]["status"] == AGREES  # only what was perturbed
    assert "DIFFERS" in output and "loss" in report["verdict"]


def test_a_host_metric_off_by_1_001_and_a_metric_the_plugin_drops_are_caught(fake_nemo_rl, tmp_path, monkeypatch):
    from nemo_is_plugin.adapters.nemo_rl import NeMoRLLossFn

    call, plugin_call = fake_nemo_rl.ClippedPGLossFn.__call__, NeMoRLLossFn.__call__

    def perturbed(self, *args, **kwargs):
        loss, metrics = call(self, *args, **kwargs)
        return loss, {**metrics, "probs_ratio": metrics["probs_ratio"] * 1.001}

    def dropping(self, *args, **kwargs):
        loss, metrics = plugin_call(self, *args, **kwargs)
        return loss, {k: v for k, v in metrics.items() if k != "gen_kl_error"}

    monkeypatch.setattr(fake_nemo_rl.ClippedPGLossFn, "__call__", perturbed)
    monkeypatch.setattr(NeMoRLLossFn, "__call__", dropping)
    code, report, output = compat(tmp_path, MASTER)
    assert code == 1
    parity = by_output(report["parity"])
    assert parity["metric probs_ratio"]["status"] == DIFFERS
    assert parity["metric gen_kl_error"]["status"] == DIFFERS
    assert parity["metric gen_kl_error"]["notes"] == ["not reported by the plugin"]
    assert parity["loss"]["status"] == AGREES
    assert "metric probs_ratio" in report["verdict"] and "metric gen_kl_error" in report["verdict"]


def test_a_config_the_plugin_refuses_exits_2_before_comparing(fake_nemo_rl, tmp_path):
    # a truncation ratio without its type: NeMo-RL refuses at the first call, the plugin when it is built
    code, report, output = compat(tmp_path, MASTER.replace("  truncated_importance_sampling_type: tis\n", ""))
    assert code == 2 and report is None
    assert "truncated_importance_sampling" in output


def test_score_centering_is_refused_in_one_line_before_comparing(fake_nemo_rl, tmp_path):
    code, report, output = compat(tmp_path, MASTER.replace("loss_fn:\n", "loss_fn:\n  score_centering: true\n", 1))
    assert code == 2 and report is None
    assert "score_centering: NeMo-RL's ClippedPGLossFn has no score centering" in " ".join(output.split())


def test_without_nemo_rl_installed_one_line_names_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "nemo_rl", None)  # not importable, whatever the machine has
    code, report, output = compat(tmp_path, MASTER)
    assert code == 2 and report is None
    line = output.strip()
    assert "\n" not in line
    assert line.startswith("nemo-is compat: NeMo-RL is not importable here")
    assert "uv run nemo-is compat" in line and "github.com/NVIDIA-NeMo/RL" in line


def test_unreadable_config_exits_2(fake_nemo_rl, tmp_path):
    code, _, output = compat(tmp_path, "loss_fn:\n  ratio_clip_mxa: 0.3\n")
    assert code == 2 and "ratio_clip_max" in output  # the nearest key is named
    line = output.strip()
    assert "\n" not in line and "neither NeMo-RL's ClippedPGLossFn nor the plugin reads them" in line
    assert "NEMO_IS_STRICT_CONFIG" not in line  # an environment switch is no advice inside a refusal


# NeMo-RL's distillation recipes (examples/configs/distillation_math.yaml and recipes/llm/distillation-*.yaml at commit
# 7ea279ab): a `distillation` section, and loss_fn keys of DistillationLossConfig.
DISTILLATION = """\
distillation:
  num_prompts_per_step: 128
  topk_logits_k: 64
loss_fn:
  kl_type: mixed
  mixed_kl_weight: 0.5
  zero_outside_topk: false
"""


@pytest.mark.parametrize(
    "text, says",
    [
        (DISTILLATION, "a NeMo-RL distillation recipe (loss_fn keys kl_type, mixed_kl_weight, zero_outside_topk)"),
        ("loss_fn:\n  kl_type: reverse\n", "a NeMo-RL distillation loss_fn section (loss_fn keys kl_type)"),
        (
            "dpo:\n  reference_policy_kl_penalty: 0.05\npolicy: {}\n",
            "a NeMo-RL dpo recipe: its loss is NeMo-RL's DPOLossFn",
        ),
        ("sft:\n  max_num_epochs: 1\n", "a NeMo-RL sft recipe: its loss is NeMo-RL's NLLLossFn"),
    ],
)
def test_a_recipe_of_another_nemo_rl_loss_says_there_is_nothing_to_compare(fake_nemo_rl, tmp_path, text, says):
    code, report, output = compat(tmp_path, text)
    assert code == 2 and report is None
    (line,) = output.strip().splitlines()
    assert says in line and "not ClippedPGLossFn, the loss the plugin replaces" in line
    assert "unknown" not in line and "NEMO_IS_STRICT_CONFIG" not in line


def test_a_grpo_recipe_with_a_distillation_key_is_a_typo_not_another_loss(fake_nemo_rl, tmp_path):
    code, _, output = compat(tmp_path, MASTER + "  kl_type: reverse\n")
    assert code == 2 and "unknown loss_fn key(s): 'kl_type'" in output


def test_rollout_dump_batches_are_compared_too(fake_nemo_rl, tmp_path):
    from nemo_is_plugin.adapters.rollout_dump import RolloutDumper

    g = torch.Generator().manual_seed(3)
    prev = -torch.rand(20, 12, generator=g) * 2
    gen = (prev + 0.1 * torch.randn(20, 12, generator=g)).clamp(max=0.0)
    mask = (torch.rand(20, 12, generator=g) > 0.2).float()
    dump = tmp_path / "rollouts.jsonl"
    RolloutDumper(dump).write(prev, gen, mask, step=0, advantages=torch.randn(20, generator=g))
    code, report, output = compat(tmp_path, MASTER, "--rollouts", str(dump), "--batches", "2")
    assert code == 0, output
    assert report["batches"][2:] == ["rollouts 0-15", "rollouts 16-19"]
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    code, _, output = compat(tmp_path, MASTER, "--rollouts", str(tmp_path / "bad.jsonl"))
    assert code == 2 and "--rollouts" in output
