"""The verl loss-mode suite's generator (tools/golden/verl_loss_modes.py): its README tolerances, its fresh inputs, and
its two sources of verl, a checkout (``--repo``) or the installed release the suite records (``--installed``).

Regenerating from the installed verl needs verl 0.9.1 (the test environment's); the rest runs without verl."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import pytest
import torch

from tools.golden import common, verl_loss_modes

GOLDEN = Path(__file__).resolve().parents[1] / "data" / "golden" / "verl_loss_modes"
EXACT = lambda _: (0.0, 0.0)  # noqa: E731


def _case(name: str) -> dict:
    return common.load_case(GOLDEN / f"{name}.pt")


def test_loss_metrics_and_gradient_compare_within_the_readme_tolerance_and_the_rest_exactly():
    case = _case("case_000")
    got = copy.deepcopy(case)
    got["expected"]["loss"] = case["expected"]["loss"] * (1 + 5e-6)  # within rtol 1e-5
    got["expected"]["grad_log_prob"] = case["expected"]["grad_log_prob"] + 5e-8  # within atol 1e-7
    assert common.diff_case(got, case, verl_loss_modes.tolerance) == []
    got["expected"]["loss"] = case["expected"]["loss"] * (1 + 1e-4)
    got["expected"]["grad_log_prob"][0, 0] += 1e-6
    got["expected"]["metrics"]["actor/ppo_kl"] += 1e-4
    got["config"]["clip_ratio_c"] += 1e-9  # a stored config field: exact
    lines = common.diff_case(got, case, verl_loss_modes.tolerance)
    assert [line.split(":")[0] for line in lines] == [
        "config.clip_ratio_c",
        "expected.loss",
        "expected.grad_log_prob",
        "expected.metrics.actor/ppo_kl",
    ]


def test_fresh_cases_keep_mode_aggregation_config_and_mask(tmp_path):
    templates = [common.load_case(p) for p in common.case_paths(GOLDEN)]

    def regenerate(case):  # a stand-in reference: the sum of the new current log-probs
        return {"loss": case["inputs"]["log_prob"].sum()}

    written = common.fresh_suite(GOLDEN, tmp_path, len(templates), 5, verl_loss_modes.redraw, regenerate)
    assert written[0].name == f"case_{len(templates):03d}.pt"
    for i, (path, template) in enumerate(zip(written, templates)):
        case = common.load_case(path)
        inputs = case["inputs"]
        for key in ("mode", "loss_agg_mode", "config"):
            assert case[key] == template[key], key
        mask = inputs["response_mask"]
        assert torch.equal(mask, template["inputs"]["response_mask"])
        assert case["params"]["seed"] == 5 + i and case["params"]["generator"] == {"fresh_from": f"case_{i:03d}"}
        assert case["params"]["advantages"] == template["params"]["advantages"]
        for key in ("old_log_prob", "log_prob", "advantages"):
            assert inputs[key].dtype == torch.float32 and not torch.equal(inputs[key], template["inputs"][key])
        assert bool((inputs["log_prob"] <= -1e-3).all()) and bool((inputs["old_log_prob"] < 0).all())
        assert bool((inputs["advantages"][mask == 0] == 0).all())
        if case["params"]["advantages"] == "seq":  # one advantage per sequence on its tokens
            for row, row_mask in zip(inputs["advantages"], mask):
                assert row[row_mask > 0].unique().numel() == 1


def test_installed_is_an_alternative_to_repo_only_where_the_suite_offers_it():
    args = common.parse_args("verl_loss_modes", ["--installed", "--out", "o"], None, installed=True)
    assert args.installed and args.repo is None
    args = common.parse_args("verl_loss_modes", ["--repo", "r", "--out", "o"], None, installed=True)
    assert not args.installed and args.repo == Path("r")
    assert common.parse_args("ctpo", ["--repo", "r", "--out", "o"], None).installed is False
    for argv, installed in (
        (["--installed", "--out", "o"], False),  # a suite made from a checkout has no installed release
        (["--out", "o"], True),  # one source is required
        (["--repo", "r", "--installed", "--out", "o"], True),  # and only one
    ):
        with pytest.raises(SystemExit):
            common.parse_args("verl_loss_modes", argv, None, installed=installed)


def _suite_copy(tmp_path: Path) -> Path:
    golden = tmp_path / "golden"
    for name in ("case_002", "case_003"):
        common.save_case(_case(name), golden / f"{name}.pt")
    return golden


def test_run_installed_regenerates_with_the_installed_reference_and_checks(tmp_path, capsys):
    golden = _suite_copy(tmp_path)

    def no_checkout(repo):
        raise AssertionError("--installed must not import a checkout")

    def suite(regenerate):
        return dataclasses.replace(
            verl_loss_modes.SUITE, make_regenerate=no_checkout, make_regenerate_installed=lambda: regenerate
        )

    argv = ["--installed", "--golden", str(golden), "--check"]
    same = suite(lambda case: case["expected"])
    assert common.run(same, [*argv, "--out", str(tmp_path / "same")]) == 0
    assert "verl-project/verl installed; the committed suite records v0.9.1" in capsys.readouterr().out
    halved = suite(lambda case: {**case["expected"], "loss": case["expected"]["loss"] / 2})
    assert common.run(halved, [*argv, "--out", str(tmp_path / "halved")]) == 1
    assert "case_003.pt: DIFFERS\n    expected.loss: " in capsys.readouterr().out


def test_the_installed_verl_reproduces_the_committed_cases_and_another_version_is_refused(monkeypatch):
    verl = pytest.importorskip("verl")
    if verl.__version__ != verl_loss_modes.RELEASE:
        pytest.skip(f"verl {verl.__version__} installed, the suite records {verl_loss_modes.RELEASE}")
    regenerate = verl_loss_modes.make_regenerate_installed()
    for name in ("case_000", "case_003", "case_011", "case_016"):  # vanilla, gspo token-mean, sapo, dro
        case = _case(name)
        common.seed_everything(case["params"]["seed"])
        assert common.diff_values(regenerate(case), case["expected"], ("expected",), EXACT) == [], name
    monkeypatch.setattr(verl, "__version__", "0.9.0")
    with pytest.raises(SystemExit, match="the installed verl is 0.9.0"):
        verl_loss_modes.make_regenerate_installed()
