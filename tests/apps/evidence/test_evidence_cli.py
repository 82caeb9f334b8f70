"""``nemo-is evidence``: the command writes every figure and a strict-JSON file of the numbers."""

import json

import pytest
import typer
from typer.testing import CliRunner

from nemo_is_plugin.apps.cli.evidence import register
from nemo_is_plugin.apps.evidence import runner

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def app():
    app = typer.Typer()

    @app.callback()
    def _root() -> None:
        """Group, so that the command is addressed by name as under ``nemo-is``."""

    register(app)
    return app


def test_quick_run_writes_all_figures_and_json(app, tmp_path):
    res = CliRunner().invoke(app, ["evidence", "--quick", "--output-dir", str(tmp_path)])
    assert res.exit_code == 0, res.output
    for names in runner.FIGURES.values():
        for name in names:
            assert (tmp_path / name).read_bytes()[:8] == PNG_MAGIC
    data = json.loads((tmp_path / runner.JSON_NAME).read_text())
    assert set(runner.EXPERIMENTS) <= set(data)
    assert data["meta"]["quick"] is True and data["meta"]["seed"] == 0
    head = data["headline"]
    assert head["kl_gradient_bias"]["k3"]["p_value"] < 1e-6
    assert head["kl_gradient_bias"]["k2"]["p_value"] > 1e-3
    assert head["is_collapse"]["shift2_sequence_mean_9k"] < 1e-50
    assert head["objectives"]["sapo"]["gate weight at r=1 (A>0)"] == pytest.approx(1.0, abs=1e-8)
    assert head["objectives"]["cppo"]["smallest delta_b with no budget-only drop, s=1"] <= 1.0
    assert set(data["objectives"]) == {"drift_sweep", "sapo_gate", "gmpo_spread", "cppo_budget"}
    assert "IS collapse" in res.output and "KL gradient" in res.output and "Policy objectives" in res.output
    assert "IS rejection rules" in res.output


def test_only_objectives_writes_its_figure_and_numbers(app, tmp_path):
    res = CliRunner().invoke(app, ["evidence", "--quick", "--only", "objectives", "--output-dir", str(tmp_path)])
    assert res.exit_code == 0, res.output
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*runner.FIGURES["objectives"], runner.JSON_NAME])
    data = json.loads((tmp_path / runner.JSON_NAME).read_text())
    assert set(data["headline"]) == {"objectives"}
    sweep = data["objectives"]["drift_sweep"]
    assert sweep["num_seqs"] == runner.QUICK.objective_num_seqs and sweep["length"] == runner.QUICK.objective_length
    assert "dppo_tv" in res.output and "dropped fraction" in res.output


def test_only_rejection_writes_its_figure_and_numbers(app, tmp_path):
    res = CliRunner().invoke(app, ["evidence", "--quick", "--only", "rejection", "--output-dir", str(tmp_path)])
    assert res.exit_code == 0, res.output
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*runner.FIGURES["rejection"], runner.JSON_NAME])
    assert (tmp_path / runner.FIGURES["rejection"][0]).read_bytes()[:8] == PNG_MAGIC
    data = json.loads((tmp_path / runner.JSON_NAME).read_text())
    assert set(data["headline"]) == {"rejection"}
    sweep = data["rejection"]["mismatch_sweep"]
    assert sweep["num_seqs"] == runner.QUICK.rejection_num_seqs and sweep["length"] == runner.QUICK.rejection_length
    assert data["rejection"]["mismatch_sweep"]["statistics"]["prob_diff"]["rejected_fraction"][0] == 0.0
    assert "token_prob_diff" in res.output and "matched threshold" in res.output


def test_same_seed_same_numbers(tmp_path):
    a = runner.run_evidence(tmp_path / "a", quick=True, only=["kl_gradient_bias"], seed=4)
    b = runner.run_evidence(tmp_path / "b", quick=True, only=["kl_gradient_bias"], seed=4)
    assert a["kl_gradient_bias"] == b["kl_gradient_bias"]
    assert "is_collapse" not in a and "is_collapse" not in a["headline"]


def test_unknown_experiment_is_rejected(app, tmp_path):
    res = CliRunner().invoke(app, ["evidence", "--only", "nope", "--output-dir", str(tmp_path)])
    assert res.exit_code == 2
    assert "unknown experiment" in res.output
    assert not any(tmp_path.iterdir())
