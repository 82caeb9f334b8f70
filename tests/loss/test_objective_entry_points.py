"""A policy objective of another package, installed with pip and found through the entry-point group
``nemo_is_plugin.objectives``: it validates (its keys' ranges and the shared rules included), shows in
``nemo-is validate --show-effective``, and computes like a built-in objective.

The package (``scaled_gpg``: GPG's -A log pi times a key of its own) is written here, outside the source tree, and
installed into a scratch target directory; the checks run in a fresh interpreter with that directory on its path, so
the entry point is what brings it in (this interpreter has built the config without it). About 5 s (pip, one
interpreter importing torch).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from helpers.site_checks import run_with_site

from nemo_is_plugin.loss.objectives import BUILTIN_OBJECTIVES, ENTRY_POINT_GROUP, objective_names, register_objective
from nemo_is_plugin.loss.objectives.base import PolicyObjective

ROOT = Path(__file__).resolve().parents[2]

PYPROJECT = f"""
[build-system]
requires = ["setuptools"]
build-backend = "setuptools.build_meta"

[project]
name = "scaled-gpg"
version = "0.1"

[project.entry-points."{ENTRY_POINT_GROUP}"]
scaled_gpg = "scaled_gpg"
"""

MODULE = """
from typing import Annotated

from pydantic import Field

from nemo_is_plugin.config.field_types import NumericRange
from nemo_is_plugin.config.keys import KeySection
from nemo_is_plugin.loss.objectives.base import ObjectiveOut, PolicyObjective, register_objective
from nemo_is_plugin.loss.objectives.gpg import gpg_surrogate


class ScaledGpgKeys(KeySection):
    scaled_gpg_scale: Annotated[
        float, NumericRange(low=0.0, low_open=True, why="a scale <= 0 ascends the loss", fix="use a positive scale")
    ] = Field(1.0, description="s in -s A log pi.")


@register_objective
class ScaledGpg(PolicyObjective):
    name = "scaled_gpg"
    keys = ScaledGpgKeys
    summary = "'scaled_gpg' (-s A log pi)"

    def surrogate(self, t):
        out = gpg_surrogate(t.curr, t.advantages)
        out.loss = ScaledGpgKeys.of(t.config).scaled_gpg_scale * out.loss
        return ObjectiveOut(out)

    def describe(self, cfg):
        return f"scaled_gpg: none (-{ScaledGpgKeys.of(cfg).scaled_gpg_scale:g} A log pi)"
"""

CHECKS = """
import dataclasses, json, sys, warnings
import torch
from typer.testing import CliRunner
from nemo_is_plugin.apps.cli.main import app
from nemo_is_plugin.config import ConfigError
from nemo_is_plugin.loss.config_model import ClippedPGLossConfig, load_loss_config
from nemo_is_plugin.loss import ClippedPGLoss, LossInputs
from nemo_is_plugin.loss.layout import TokenLayout
from nemo_is_plugin.loss.objectives import objective_names

def refusal(section):
    try:
        load_loss_config(section)
    except ConfigError as exc:
        return str(exc)
    return None

g = torch.Generator().manual_seed(0)
B, T = 3, 6
prev = torch.log(torch.rand(B, T, generator=g, dtype=torch.float64) * 0.9 + 0.05)
c0 = (prev + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)).clamp(max=-1e-3)
adv = torch.tensor([1.5, -0.7, 0.4], dtype=torch.float64)[:, None].expand(B, T).clone()
tm = torch.ones(B, T, dtype=torch.float64)
tm[0, 4:] = 0
sm = torch.ones(B, dtype=torch.float64)
inputs = LossInputs(curr_logprobs=c0, prev_logprobs=prev, generation_logprobs=prev, reference_logprobs=prev,
                    advantages=adv, token_mask=tm, sample_mask=sm, global_valid_seqs=float(B),
                    global_valid_toks=float(tm.sum()))

def loss_and_grad(section):
    c = c0.clone().requires_grad_(True)
    loss, _ = ClippedPGLoss(section).compute(dataclasses.replace(inputs, curr_logprobs=c), TokenLayout.padded(B, T))
    (grad,) = torch.autograd.grad(loss, c)
    return loss.detach(), grad

base = {"reference_policy_kl_penalty": 0.0, "loss_aggregation": "token-mean"}
mine = loss_and_grad({**base, "policy_objective": "scaled_gpg", "scaled_gpg_scale": 2.5})
gpg = loss_and_grad({**base, "policy_objective": "gpg"})
# hand value: token-mean of -2.5 A c over the unmasked tokens, divided by n + 1e-8 (NeMo-RL's masked_mean eps,
# loss/aggregation.py); gradient -2.5 A / (n + 1e-8) on them, 0 on the masked ones
n = float(tm.sum()) + 1e-8
hand_loss = float((-2.5 * adv * c0 * tm).sum() / n)
shown = CliRunner().invoke(app, ["validate", sys.argv[1], "--show-effective"], env={"COLUMNS": "200"})
print(json.dumps({
    "names": list(objective_names()),
    "scale": load_loss_config({"policy_objective": "scaled_gpg", "scaled_gpg_scale": 2.5}).scaled_gpg_scale,
    "default_scale": ClippedPGLossConfig().scaled_gpg_scale,
    "bad_scale": refusal({"policy_objective": "scaled_gpg", "scaled_gpg_scale": 0.0}),
    "unread": refusal({"scaled_gpg_scale": 3.0}),
    "ratio_level": refusal({"policy_objective": "scaled_gpg", "ratio_level": "sequence"}),
    "loss": float(mine[0]), "hand_loss": hand_loss, "gpg_loss": float(gpg[0]),
    "grad_vs_gpg": float((mine[1] - 2.5 * gpg[1]).abs().max()),
    "grad_vs_hand": float((mine[1] - (-2.5 * adv * tm / n)).abs().max()),
    "cli_exit": shown.exit_code, "cli": shown.output,
}))
"""


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The package installed by pip into a scratch target directory (no index, no build isolation: nothing is
    downloaded; setuptools is the build backend the test environment has)."""
    pytest.importorskip("setuptools", reason="building the scratch objective package needs setuptools")
    work = tmp_path_factory.mktemp("scaled_gpg")
    (work / "src").mkdir()
    (work / "src" / "pyproject.toml").write_text(PYPROJECT)
    (work / "src" / "scaled_gpg.py").write_text(textwrap.dedent(MODULE))
    target = work / "site"
    done = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", "--no-build-isolation",
         "--target", str(target), str(work / "src")],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    if done.returncode != 0 and "No module named pip" in done.stderr:
        pytest.skip("installing the scratch objective package needs pip in the test interpreter")
    assert done.returncode == 0, done.stderr
    assert (target / "scaled_gpg.py").is_file()
    return target


def test_an_installed_objective_validates_shows_and_computes_like_a_built_in(installed, tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("loss_fn:\n  policy_objective: scaled_gpg\n  scaled_gpg_scale: 2.5\n")
    got = run_with_site(CHECKS, installed, str(recipe))
    builtin = len(BUILTIN_OBJECTIVES)  # then the entry points' objectives (the example package's too, where installed)
    assert got["names"][:builtin] == list(objective_names()[:builtin]) and "scaled_gpg" in got["names"][builtin:]
    assert got["scale"] == 2.5 and got["default_scale"] == 1.0
    assert "scaled_gpg_scale" in got["bad_scale"] and "use a positive scale" in got["bad_scale"]
    assert "scaled_gpg_scale is read by policy_objective scaled_gpg only, not 'ppo_clip': unset it" in got["unread"]
    assert "policy_objective='scaled_gpg' uses no policy ratio: unset ratio_level='sequence'" in got["ratio_level"]
    assert got["loss"] == pytest.approx(got["hand_loss"], rel=1e-12)
    assert got["loss"] == pytest.approx(2.5 * got["gpg_loss"], rel=1e-12)
    assert got["grad_vs_gpg"] < 1e-15 and got["grad_vs_hand"] < 1e-15
    assert got["cli_exit"] == 0, got["cli"]
    assert "scaled_gpg: none (-2.5 A log pi)" in got["cli"] and "scaled_gpg_scale" in got["cli"]


def test_a_registration_after_the_config_is_built_is_refused():
    from nemo_is_plugin.loss.config_model import ClippedPGLossConfig

    class Late(PolicyObjective):
        name = "late_objective"

    assert "policy_objective" in ClippedPGLossConfig.model_fields  # the model is built (and the registry sealed)
    with pytest.raises(ValueError, match="registered after ClippedPGLossConfig was built.*nemo_is_plugin.objectives"):
        register_objective(Late)
