"""The shipped examples and the docs' ``nemo-is compat`` command lines run as written: the NeMo-RL recipe
(configs/examples/nemo_rl_grpo_tis.yaml) against the fake installed NeMo-RL (conftest.py), the verl Hydra config
(configs/examples/verl_ctpo_seqmean.yaml) against the installed verl; each is accepted (exit 0) and agrees."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_docs import COMMANDS
from typer.testing import CliRunner

from nemo_is_plugin.apps.cli.main import app

ROOT = Path(__file__).resolve().parents[3]
DOC_COMPAT = [c for c in COMMANDS if c[2][0] == "compat" and len(c[2]) > 1 and (ROOT / c[2][1]).is_file()]


def _verl_installed() -> bool:
    try:
        import verl.trainer.ppo.core_algos  # noqa: F401
    except ImportError:
        return False
    return True


def _run(args: list[str], tmp_path: Path) -> tuple[int, dict, str]:
    out = tmp_path / "report.json"
    result = CliRunner().invoke(app, [*args, "--json", str(out)])
    return result.exit_code, json.loads(out.read_text()) if out.exists() else {}, result.output


def test_the_docs_show_compat_on_each_shipped_example():
    shown = {(args[1], "--host" in args and args[args.index("--host") + 1] == "verl") for _, _, args in DOC_COMPAT}
    assert ("configs/examples/nemo_rl_grpo_tis.yaml", False) in shown
    assert ("configs/examples/verl_ctpo_seqmean.yaml", True) in shown
    assert any(page == "README.md" for page, _, _ in DOC_COMPAT)


@pytest.mark.parametrize("case", DOC_COMPAT, ids=lambda c: f"{c[0]}: {' '.join(c[2])}")
def test_a_compat_command_of_the_docs_runs_and_agrees(case, fake_nemo_rl, monkeypatch, tmp_path):
    args = case[2]
    if "verl" in args and not _verl_installed():
        pytest.skip("verl is not importable: pip install 'nemo-is-plugin[verl]'")
    monkeypatch.chdir(ROOT)
    code, report, output = _run(args, tmp_path)
    assert code == 0, output
    assert report["agrees"] and "AGREES" in output


def test_the_nemo_rl_example_is_nemo_rls_loss_with_no_plugin_key(fake_nemo_rl, monkeypatch, tmp_path):
    monkeypatch.chdir(ROOT)
    code, report, output = _run(["compat", "configs/examples/nemo_rl_grpo_tis.yaml"], tmp_path)
    assert code == 0, output
    assert report["plugin_keys"] == {"is_correction_level": None} and report["changes"] == []
    assert {f["status"] for f in report["parity"]} == {"agrees", "plugin only"}  # no difference, no failure


@pytest.mark.skipif(not _verl_installed(), reason="verl is not importable")
def test_the_verl_example_agrees_on_verls_part_and_lists_what_ctpo_changes(monkeypatch, tmp_path):
    monkeypatch.chdir(ROOT)
    code, report, output = _run(["compat", "configs/examples/verl_ctpo_seqmean.yaml", "--host", "verl"], tmp_path)
    assert code == 0, output
    assert {f["status"] for f in report["parity"]} == {"agrees", "plugin only"}  # no difference, no failure
    assert report["plugin_keys"]["ratio_level"] == "cumulative"
    changed = {f["output"]: f for f in report["changes"]}
    assert {"loss", "gradient"} <= set(changed)
    assert "ratio_level" in changed["loss"]["notes"][0]
