"""An installed package whose objective entry points fail to load breaks nothing but the configs that name its
objectives: the other configs validate and run (one warning naming the entry point), a config naming an objective
nothing registers is refused in one line naming the failed entry points, why and the fix (CLI exit 2), and what a
failing module registered before it failed is taken back. A misspelled ``policy_objective`` gets a "did you mean".

The broken package is a distribution's metadata written by hand (``entry_points.txt``: one entry point naming a module
that does not exist, one naming a module that registers an objective and then raises), checked in a fresh interpreter
with its directory on the path. About 10 s (one interpreter importing torch and the CLI).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.site_checks import run_with_site

from nemo_is_plugin.config import ConfigError
from nemo_is_plugin.loss.config_model import load_loss_config
from nemo_is_plugin.loss.objectives import ENTRY_POINT_GROUP

ROOT = Path(__file__).resolve().parents[2]

HALF_BROKEN = """
from nemo_is_plugin.loss.objectives.base import PolicyObjective, register_objective


@register_objective
class HalfBroken(PolicyObjective):
    name = "half_broken"


raise RuntimeError("half_broken fails after registering")
"""

CHECKS = """
import json, sys, warnings
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    from nemo_is_plugin.loss.objectives import BUILTIN_OBJECTIVES, objective_names
    from nemo_is_plugin.loss.config_model import ClippedPGLossConfig
from typer.testing import CliRunner
from nemo_is_plugin import build_loss_fn
from nemo_is_plugin.apps.cli.main import app

default_recipe, naming_recipe = sys.argv[1:3]
runner = CliRunner()
default = runner.invoke(app, ["validate", default_recipe, "--json"])
naming = runner.invoke(app, ["validate", naming_recipe, "--json"])
print(json.dumps({
    "warnings": [str(w.message) for w in caught if type(w.message).__name__ == "ObjectiveEntryPointWarning"],
    "extra_names": [n for n in objective_names() if n not in BUILTIN_OBJECTIVES],
    "default_loss": type(build_loss_fn({})).__name__,
    "default_exit": default.exit_code, "default_valid": json.loads(default.stdout)["valid"],
    "naming_exit": naming.exit_code, "naming_error": json.loads(naming.stdout)["error"],
}))
"""


@pytest.fixture(scope="module")
def broken_site(tmp_path_factory) -> Path:
    site = tmp_path_factory.mktemp("broken_site")
    info = site / "broken_objectives-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-objectives\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        f"[{ENTRY_POINT_GROUP}]\nhalf = half_broken\nmissing = missing_objective_module\n"
    )
    (site / "half_broken.py").write_text(HALF_BROKEN)
    return site


def test_a_broken_entry_point_breaks_only_the_configs_naming_its_objective(broken_site, tmp_path):
    naming = tmp_path / "naming.yaml"
    naming.write_text("loss_fn:\n  policy_objective: missing_objective\n")
    default = str(ROOT / "configs" / "nemo_rl_default_grpo.yaml")
    got = run_with_site(CHECKS, broken_site, default, str(naming), COLUMNS="200")
    # one warning per failed entry point, naming it, its package, the error and the fix
    half, missing = got["warnings"]
    assert "'half = half_broken' of package 'broken-objectives' failed to load (RuntimeError: half_broken fails" in half
    assert "'missing = missing_objective_module'" in missing and "No module named 'missing_objective_module'" in missing
    assert "configs that do not name them are unaffected" in missing and "pip uninstall broken-objectives" in missing
    assert "half_broken" not in got["extra_names"]  # registered, then taken back when its module failed
    assert got["default_loss"] == "ClippedPGLoss"
    assert got["default_exit"] == 0 and got["default_valid"] is True
    assert got["naming_exit"] == 2
    # the refusal is one line: the name, the entry points that failed, why, and the fix
    (line,) = [ln for ln in got["naming_error"].splitlines() if "is not a registered objective" in ln]
    assert "policy_objective='missing_objective' is not a registered objective; registered: ppo_clip," in line
    assert "may provide it but failed: 'half = half_broken' of package 'broken-objectives' failed to load" in line
    assert "(ModuleNotFoundError: No module named 'missing_objective_module'): repair or reinstall" in line


@pytest.mark.parametrize(
    "typo, near", [("dppo_vt", "dppo_tv"), ("ppo-clip", "ppo_clip"), ("reinforse", "reinforce"), ("cisp", "cispo")]
)
def test_a_misspelled_objective_gets_a_did_you_mean(typo, near):
    with pytest.raises(ConfigError) as err:
        load_loss_config({"policy_objective": typo})
    (error,) = err.value.errors()
    assert error["loc"] == ("policy_objective",)
    assert f"policy_objective={typo!r} is not a registered objective (did you mean {near!r}?); registered: " in str(
        err.value
    )


def test_an_unrelated_name_lists_the_objectives_and_how_to_register_one():
    with pytest.raises(
        ConfigError, match=r"registered: ppo_clip, .*entry point in the group 'nemo_is_plugin\.objectives'"
    ):
        load_loss_config({"policy_objective": "zzzz"})
