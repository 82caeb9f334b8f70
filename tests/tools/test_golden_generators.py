"""The golden-suite generators' shared machinery (tools/golden/common.py and checkout.py), without any host checkout:
the comparison flags what the suite tolerances forbid and passes what they allow, the writer round-trips the case
format, a regeneration carries every entry but ``expected`` over, and the import helpers stub and locate modules as
documented.

The regeneration itself needs the hosts' checkouts (docs/testing.md, "Refreshing the golden suites")."""

from __future__ import annotations

import copy
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tools.golden import checkout, common, ctpo, nemo_rl, slime, verl_rollout_corr

GOLDEN = Path(__file__).resolve().parents[1] / "data" / "golden"


def _case(suite: str, name: str) -> dict:
    return common.load_case(GOLDEN / suite / f"{name}.pt")


def test_default_golden_dir_is_the_committed_suites():
    assert common.GOLDEN == GOLDEN
    assert common.case_paths(GOLDEN / "ctpo")


@pytest.mark.parametrize(
    ("suite", "name", "tolerance"),
    [
        ("ctpo", "case_000", ctpo.tolerance),
        ("ctpo", "case_042", ctpo.tolerance),  # an error case
        ("nemo_rl", "case_000", nemo_rl.tolerance),
        ("nemo_rl", "case_097", nemo_rl.tolerance),  # a rejected config
        ("nemo_rl_compat", "case_000", nemo_rl.tolerance),
        ("verl_rollout_corr", "case_008", verl_rollout_corr.tolerance),  # no IS weights (None)
    ],
)
def test_an_identical_case_passes(suite, name, tolerance):
    case = _case(suite, name)
    assert common.diff_case(copy.deepcopy(case), case, tolerance) == []


def test_a_loss_beyond_tolerance_is_flagged_and_one_within_passes():
    case = _case("ctpo", "case_000")  # T = 256: rtol 1e-5, atol 1e-6
    want = float(case["expected"]["pg_loss"])
    for factor, flagged in ((1 + 1e-3, True), (1 + 1e-7, False)):
        got = copy.deepcopy(case)
        got["expected"]["pg_loss"] = torch.tensor(want * factor, dtype=torch.float32)
        lines = common.diff_case(got, case, ctpo.tolerance)
        assert bool(lines) is flagged, lines
        if flagged:
            assert lines[0].startswith("expected.pg_loss:")


def test_one_gradient_entry_beyond_tolerance_is_counted():
    case = _case("ctpo", "case_000")
    got = copy.deepcopy(case)
    grad = got["expected"]["grad_log_prob"]
    i = int(grad.abs().flatten().argmax())
    grad.view(-1)[i] += 1e-3
    (line,) = common.diff_case(got, case, ctpo.tolerance)
    assert line.startswith("expected.grad_log_prob: 1 entries beyond rtol 1e-05")


def test_counts_are_exact_and_float_metrics_have_a_tolerance():
    case = _case("ctpo", "case_000")
    got = copy.deepcopy(case)
    got["expected"]["metrics"]["pg_update/clip/high/count"] += 1.0
    got["expected"]["metrics"]["actor/pg_clipfrac"] *= 1 + 1e-7
    (line,) = common.diff_case(got, case, ctpo.tolerance)
    assert line.startswith("expected.metrics.pg_update/clip/high/count:")


def test_nemo_rl_tolerances_follow_the_readme():
    case = _case("nemo_rl", "case_000")
    metrics = case["expected"]["metrics"]
    got = copy.deepcopy(case)
    # KL-type metric: rtol 1e-3 allows 5e-4; a plain metric (rtol 1e-4) does not.
    got["expected"]["metrics"]["gen_kl_error"] = metrics["gen_kl_error"] * (1 + 5e-4)
    assert common.diff_case(got, case, nemo_rl.tolerance) == []
    got["expected"]["metrics"]["approx_entropy"] = metrics["approx_entropy"] * (1 + 5e-4)
    (line,) = common.diff_case(got, case, nemo_rl.tolerance)
    assert line.startswith("expected.metrics.approx_entropy:")


def test_a_missing_or_extra_metric_and_a_changed_input_are_flagged():
    case = _case("verl_rollout_corr", "case_000")
    got = copy.deepcopy(case)
    name = next(iter(got["expected"]["metrics"]))
    del got["expected"]["metrics"][name]
    got["expected"]["metrics"]["rollout_corr/new_metric"] = 1.0
    got["inputs"]["old_log_prob"][0, 0] += 1e-6  # inputs must match exactly
    lines = common.diff_case(got, case, verl_rollout_corr.tolerance)
    assert f"expected.metrics: missing key {name!r}" in lines
    assert "expected.metrics: extra key 'rollout_corr/new_metric'" in lines
    assert any(line.startswith("inputs.old_log_prob: 1 entries") for line in lines)


def test_masks_compare_exactly_and_none_against_a_tensor_is_flagged():
    case = _case("verl_rollout_corr", "case_008")
    got = copy.deepcopy(case)
    got["expected"]["modified_response_mask"][0, 0] = 1 - got["expected"]["modified_response_mask"][0, 0]
    got["expected"]["rollout_is_weights"] = torch.ones_like(got["expected"]["modified_response_mask"])
    lines = common.diff_case(got, case, verl_rollout_corr.tolerance)
    assert any(line.startswith("expected.modified_response_mask: 1 entries beyond rtol 0") for line in lines)
    assert any(line.startswith("expected.rollout_is_weights: got") for line in lines)


def test_inf_and_nan_must_match_exactly():
    tol = lambda path: (1.0, 1.0)  # noqa: E731  (generous, so only the non-finite rule can fail)
    want = torch.tensor([float("inf"), float("nan"), 1.0])
    assert common.diff_values(want.clone(), want, ("x",), tol) == []
    assert common.diff_values(torch.tensor([1e30, float("nan"), 1.0]), want, ("x",), tol)
    assert common.diff_values(torch.tensor([float("inf"), 0.0, 1.0]), want, ("x",), tol)
    assert common.diff_values(float("-inf"), float("inf"), ("m",), tol)
    assert common.diff_values(float("nan"), float("nan"), ("m",), tol) == []


def test_the_writer_round_trips_the_case_format(tmp_path):
    for suite, name in (("nemo_rl", "case_085"), ("ctpo", "case_042"), ("verl_rollout_corr", "case_008")):
        case = _case(suite, name)
        common.save_case(case, tmp_path / suite / f"{name}.pt")
        back = torch.load(tmp_path / suite / f"{name}.pt", weights_only=True)
        assert list(back) == list(case)
        assert common.diff_values(back, case, (), lambda _: (0.0, 0.0)) == []


def test_to_metrics_stores_floats():
    metrics = common.to_metrics({"a": torch.tensor(0.5), "b": 3, "c": 1.25})
    assert metrics == {"a": 0.5, "b": 3.0, "c": 1.25}
    assert all(type(v) is float for v in metrics.values())


def _suite_copy(tmp_path: Path, names: list[str]) -> Path:
    directory = tmp_path / "committed"
    for name in names:
        common.save_case(_case("ctpo", name), directory / f"{name}.pt")
    return directory


def test_regenerating_carries_everything_but_expected_over(tmp_path):
    committed = _suite_copy(tmp_path, ["case_000", "case_042"])
    seen = []

    def regenerate(case):  # a reference that doubles the loss and fails nothing
        seen.append(torch.initial_seed())
        if "error" in case["expected"]:
            return case["expected"]
        return {**case["expected"], "pg_loss": case["expected"]["pg_loss"] * 2}

    assert common.regenerate_suite(committed, tmp_path / "out", regenerate) == 2
    assert seen == [_case("ctpo", "case_000")["params"]["seed"], _case("ctpo", "case_042")["params"]["seed"]]
    lines: list[str] = []
    assert common.compare_dirs(tmp_path / "out", committed, ctpo.tolerance, lines.append) == 1
    assert lines[0] == "case_000.pt: DIFFERS"
    assert lines[1].startswith("    expected.pg_loss:")
    assert lines[2] == "case_042.pt: ok (bitwise identical)"
    assert lines[-1] == "1/2 cases agree within tolerance (1 bitwise identical)"


def test_a_case_on_one_side_only_differs(tmp_path):
    committed = _suite_copy(tmp_path, ["case_000", "case_001"])
    regenerated = tmp_path / "regenerated"
    common.save_case(_case("ctpo", "case_000"), regenerated / "case_000.pt")
    lines: list[str] = []
    assert common.compare_dirs(regenerated, committed, ctpo.tolerance, lines.append) == 1
    assert "case_001.pt: only in the committed suite" in lines


def test_stubs_stand_in_only_for_the_named_missing_packages(monkeypatch):
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    monkeypatch.setattr(sys, "modules", dict(sys.modules))
    checkout.install_stubs(if_missing=["nemo_is_absent_pkg", "torch"])
    import nemo_is_absent_pkg.sub as stub  # noqa: F401  (stubbed: not installed)

    class Model(stub.PreTrainedModel):  # usable as a base class
        pass

    @stub.remote  # and as a bare decorator, which hands the function back
    def f():
        return 7

    assert f() == 7
    assert isinstance(Model(1, x=2), stub.PreTrainedModel)
    import torch as real_torch  # installed: never stubbed by if_missing

    assert hasattr(real_torch, "tensor") and real_torch.__file__
    with pytest.raises(ModuleNotFoundError):
        import nemo_is_other_absent_pkg  # noqa: F401  (not named)


def test_use_checkout_imports_the_checkout_and_refuses_a_wrong_path(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setattr(sys, "modules", dict(sys.modules))
    (tmp_path / "fake_host").mkdir()
    (tmp_path / "fake_host" / "__init__.py").write_text(textwrap.dedent("VALUE = 3\n"))
    module = checkout.use_checkout(tmp_path, "fake_host")
    assert module.VALUE == 3 and Path(module.__file__).parent == tmp_path / "fake_host"
    with pytest.raises(SystemExit, match="no 'other_host/' package there"):
        checkout.use_checkout(tmp_path, "other_host")


def _fresh(tmp_path: Path, suite: str, redraw, count: int, seed: int) -> list[dict]:
    """Fresh cases of a committed suite with a stand-in reference that records the inputs' sum (no checkout)."""

    def regenerate(case):
        return {"inputs_sum": sum(float(v.sum()) for v in case["inputs"].values() if isinstance(v, torch.Tensor))}

    out = tmp_path / f"{suite}-{seed}"
    written = common.fresh_suite(GOLDEN / suite, out, count, seed, redraw, regenerate)
    return [common.load_case(p) for p in written]


def test_fresh_cases_follow_the_suite_with_new_inputs_on_each_valid_config(tmp_path):
    cases = _fresh(tmp_path, "ctpo", ctpo.redraw, 3, seed=7)
    assert [p.name for p in common.case_paths(tmp_path / "ctpo-7")] == ["case_044.pt", "case_045.pt", "case_046.pt"]
    for i, case in enumerate(cases):
        template = _case("ctpo", f"case_{i:03d}")
        assert case["params"]["config"] == template["params"]["config"]
        assert case["params"]["seed"] == 7 + i and case["params"]["generator"] == {"fresh_from": f"case_{i:03d}"}
        assert torch.equal(case["inputs"]["response_mask"], template["inputs"]["response_mask"])
        for name in ("old_log_prob", "log_prob", "advantages"):
            assert case["inputs"][name].shape == template["inputs"][name].shape
            assert not torch.equal(case["inputs"][name], template["inputs"][name])
        mask = case["inputs"]["response_mask"]
        assert bool((case["inputs"]["old_log_prob"] < 0).all())
        assert bool((case["inputs"]["advantages"][mask == 0] == 0).all())
        assert case["description"].startswith(f"fresh inputs (seed {7 + i}) on case_{i:03d}'s")
        assert set(case["expected"]) == {"inputs_sum"}


def test_fresh_cases_are_a_function_of_the_seed(tmp_path):
    first = _fresh(tmp_path / "a", "verl_rollout_corr", verl_rollout_corr.redraw, 2, seed=3)
    again = _fresh(tmp_path / "b", "verl_rollout_corr", verl_rollout_corr.redraw, 2, seed=3)
    other = _fresh(tmp_path / "c", "verl_rollout_corr", verl_rollout_corr.redraw, 2, seed=4)
    exact = lambda _: (0.0, 0.0)  # noqa: E731
    assert all(common.diff_values(a, b, (), exact) == [] for a, b in zip(first, again))
    assert all(common.diff_values(a["inputs"], b["inputs"], (), exact) for a, b in zip(first, other))


def test_fresh_nemo_rl_inputs_keep_column_0_the_masks_and_non_finite_values(tmp_path):
    suite = "nemo_rl_compat"
    templates = {p.stem: common.load_case(p) for p in common.case_paths(GOLDEN / suite)}
    valid = [name for name, case in templates.items() if "error" not in case["expected"]]
    cases = _fresh(tmp_path, suite, nemo_rl.redraw, len(valid), seed=11)
    assert any(not torch.isfinite(t["inputs"]["generation_logprobs"]).all() for t in templates.values())
    for name, case in zip(valid, cases):
        new, old = case["inputs"], templates[name]["inputs"]
        assert case["id"] != name and case["notes"] == []
        for key in ("token_mask", "sample_mask", "input_ids"):
            assert torch.equal(new[key], old[key])
        for key in ("prev_logprobs", "generation_logprobs", "reference_policy_logprobs", "advantages"):
            assert torch.equal(new[key][:, 0], old[key][:, 0])  # the junk column NeMo-RL slices off
            special = ~torch.isfinite(old[key])
            assert torch.equal(new[key][special], old[key][special])
        if "curr_logprobs_unfiltered" in new:
            assert bool((new["curr_logprobs_unfiltered"] <= new["next_token_logprobs"]).all())


def test_fresh_refuses_check():
    with pytest.raises(SystemExit):
        common.parse_args("ctpo", ["--repo", "x", "--out", "y", "--fresh", "2", "--check"], None)


def test_every_committed_suite_has_a_generator_recording_its_commit():
    from tools.golden import compare

    suites = sorted(p.name for p in GOLDEN.iterdir() if p.is_dir())
    assert sorted(compare.SUITES) == suites
    for name, suite in compare.SUITES.items():
        readme = (GOLDEN / name / "README.md").read_text()
        assert suite.commit in readme
        if suite.make_regenerate_installed is None:  # made from a checkout: its commit
            assert re.fullmatch(r"[0-9a-f]{40}", suite.commit), suite.commit
        else:  # made from a released package that names no commit: the release tag
            assert re.fullmatch(r"v\d+(\.\d+)+", suite.commit), suite.commit
        for part in suite.parts:
            cases = [common.load_case(p) for p in common.case_paths(GOLDEN / name / part)]
            assert cases, f"{name}/{part}: no cases"
            assert {c["source"]["commit"] for c in cases if "source" in c} <= {suite.commit}
        parts = {p.name for p in (GOLDEN / name).iterdir() if p.is_dir()}
        assert parts == set(suite.parts) - {""}, f"{name}: case directories {parts}, the generator's {suite.parts}"


def test_compare_command_passes_a_copy_and_fails_a_changed_one(tmp_path, capsys):
    from tools.golden import compare

    committed = _suite_copy(tmp_path, ["case_000", "case_001"])
    assert compare.main(["--suite", "ctpo", str(committed), str(committed)]) == 0
    changed = tmp_path / "changed"
    case = _case("ctpo", "case_001")
    case["expected"]["metrics"]["actor/ppo_kl"] += 1.0
    common.save_case(_case("ctpo", "case_000"), changed / "case_000.pt")
    common.save_case(case, changed / "case_001.pt")
    assert compare.main(["--suite", "ctpo", str(committed), str(changed)]) == 1
    assert "case_001.pt: DIFFERS" in capsys.readouterr().out


def test_checkout_commit_reads_a_git_checkout_only(tmp_path):
    repo = tmp_path / "host"
    (repo / "pkg").mkdir(parents=True)
    assert checkout.checkout_commit(repo) is None  # a plain source tree
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git[:3], "init", "-q"], check=True)
    (repo / "pkg" / "__init__.py").write_text("")
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "x"], check=True)
    head = subprocess.run([*git[:3], "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    assert checkout.checkout_commit(repo) == head
    assert checkout.checkout_commit(repo / "pkg") is None  # a folder inside a checkout is not one


# ---------------------------------------------------------------------------------------------------- slime
# Its cases keep slime's outputs as top-level entries (Suite.outputs None) in two parts, policy/ and tis/.


def test_slime_outputs_compare_within_the_readme_tolerance_and_the_stored_call_exactly():
    policy, tis = _case("slime", "policy/case_000"), _case("slime", "tis/case_002")
    assert common.diff_case(copy.deepcopy(policy), policy, slime.tolerance, None) == []
    got = copy.deepcopy(policy)
    got["loss"] = policy["loss"] * (1 + 1e-7)  # within rtol 1e-5
    got["logits_grad"] = policy["logits_grad"] + 5e-7  # within atol 1e-6
    assert common.diff_case(got, policy, slime.tolerance, None) == []
    got["metrics"]["pg_loss"] *= 1 + 1e-3
    got["batch"]["advantages"][0][0] += 1e-7  # a stored input: exact
    got["args"]["eps_clip"] = 0.2 + 1e-9
    lines = common.diff_case(got, policy, slime.tolerance, None)
    assert [line.split(":")[0] for line in lines] == ["args.eps_clip", "batch.advantages.0", "metrics.pg_loss"]
    got = copy.deepcopy(tis)
    got["masks"] = [m.clone() for m in got["masks"]]  # slime returns the input list: the stored call holds it too
    got["masks"][0][0] = 1 - got["masks"][0][0]  # masks exact
    got["pg_loss"] = tis["pg_loss"] * (1 + 1e-6)  # beyond 1 ulp (rtol 1.2e-7)
    lines = common.diff_case(got, tis, slime.tolerance, None)
    assert [line.split(":")[0] for line in lines] == ["pg_loss", "masks.0"]


def test_slime_regeneration_stores_outputs_next_to_the_inputs(tmp_path):
    committed = tmp_path / "committed"
    case = _case("slime", "tis/case_000")
    common.save_case(case, committed / "case_000.pt")

    def regenerate(case):  # a reference that doubles the loss
        return {"pg_loss": case["pg_loss"] * 2, "masks": case["masks"], "metrics": case["metrics"]}

    assert common.regenerate_suite(committed, tmp_path / "out", regenerate, outputs=None) == 1
    back = common.load_case(tmp_path / "out" / "case_000.pt")
    assert list(back) == list(case) and "expected" not in back
    torch.testing.assert_close(back["pg_loss"], case["pg_loss"] * 2, rtol=0, atol=0)
    assert common.diff_values(back["inputs"], case["inputs"], (), lambda _: (0.0, 0.0)) == []


def test_compare_command_compares_each_part_of_slime(tmp_path, capsys):
    from tools.golden import compare

    copy_ = tmp_path / "copy"
    for part in slime.PARTS:
        for path in common.case_paths(GOLDEN / "slime" / part):
            common.save_case(common.load_case(path), copy_ / part / path.name)
    assert compare.main(["--suite", "slime", str(GOLDEN / "slime"), str(copy_)]) == 0
    out = capsys.readouterr().out
    assert "slime/policy:" in out and "slime/tis:" in out and "3/3 cases agree" in out
    changed = common.load_case(copy_ / "tis" / "case_001.pt")
    changed["metrics"]["tis"] = changed["metrics"]["tis"] * 1.01
    common.save_case(changed, copy_ / "tis" / "case_001.pt")
    assert compare.main(["--suite", "slime", str(GOLDEN / "slime"), str(copy_)]) == 1
    assert "case_001.pt: DIFFERS\n    metrics.tis: " in capsys.readouterr().out


def test_fresh_slime_cases_keep_the_args_lengths_and_masks(tmp_path):
    def regenerate(case):  # a stand-in reference: the sum of the new log-probs
        inputs = case["inputs"]["train_log_probs"] if "function" in case else case["batch"]["ref_log_probs"]
        return {"inputs_sum": float(sum(t.sum() for t in inputs))}

    for part, count in (("policy", 15), ("tis", 3)):
        out = tmp_path / part
        written = common.fresh_suite(GOLDEN / "slime" / part, out, count, 3, slime.redraw, regenerate, outputs=None)
        assert [p.name for p in written][0] == f"case_{count:03d}.pt"
        for i, path in enumerate(written):
            case, template = common.load_case(path), _case("slime", f"{part}/case_{i:03d}")
            assert case["args"] == template["args"] and case["id"] == path.stem and "inputs_sum" in case
            new, old = (case["inputs"], template["inputs"]) if part == "tis" else (case["batch"], template["batch"])
            for key in ("total_lengths", "response_lengths", "loss_masks", "rollout_mask_sums"):
                assert common.diff_values(new.get(key), old.get(key), (), lambda _: (0.0, 0.0)) == [], key
            changed = ("pg_loss", "train_log_probs") if part == "tis" else ("advantages", "ref_log_probs")
            assert all(common.diff_values(new[key], old[key], (), lambda _: (0.0, 0.0)) for key in changed)
            assert bool(new["log_probs" if part == "policy" else "train_log_probs"]) == bool(
                old["log_probs" if part == "policy" else "train_log_probs"]
            )  # the case without recomputed log-probs stays without
            if part == "policy":
                assert case["logits"].shape == template["logits"].shape
                tokens = torch.cat(new["unconcat_tokens"])
                assert bool((tokens >= 0).all() and (tokens < case["logits"].shape[-1]).all())
