"""``policy_objective: module:Class``, for experiments: a class without keys of its own is imported and registered
under its path (and computes: here 2 x GPG's loss and gradient); a class its module registered resolves to its name;
each failure (the import, the attribute, not an objective, keys of its own) is one line naming the path and the fix."""

from __future__ import annotations

import textwrap

import pytest
import torch

from nemo_is_plugin.config import ConfigError
from nemo_is_plugin.loss import ClippedPGLoss, LossInputs
from nemo_is_plugin.loss.config_model import load_loss_config
from nemo_is_plugin.loss.layout import TokenLayout

MODULE = """
from nemo_is_plugin.objectives import KeySection, ObjectiveOut, PolicyObjective, SurrogateOut


class DoubleGpg(PolicyObjective):
    name = "double_gpg"
    summary = "'double_gpg' (-2 A log pi)"

    def surrogate(self, t):
        return ObjectiveOut(SurrogateOut(loss=-2.0 * t.advantages * t.curr))


class WithKeys(PolicyObjective):
    name = "with_keys"

    class keys(KeySection):
        with_keys_scale: float = 1.0


NOT_AN_OBJECTIVE = 3
"""


@pytest.fixture
def experiment(tmp_path, monkeypatch):
    (tmp_path / "my_experiment.py").write_text(textwrap.dedent(MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    return "my_experiment"


def _loss_and_grad(objective: str):
    g = torch.Generator().manual_seed(0)
    prev = torch.log(torch.rand(2, 5, generator=g, dtype=torch.float64) * 0.9 + 0.05)
    c = (prev + 0.2 * torch.randn(2, 5, generator=g, dtype=torch.float64)).requires_grad_(True)
    adv = torch.tensor([[1.0], [-0.5]], dtype=torch.float64).expand(2, 5).clone()
    mask = torch.ones(2, 5, dtype=torch.float64)
    inputs = LossInputs(c, prev, prev, prev, adv, mask, torch.ones(2, dtype=torch.float64), 2.0, 10.0)
    section = {"policy_objective": objective, "reference_policy_kl_penalty": 0.0}
    loss, _ = ClippedPGLoss(section).compute(inputs, TokenLayout.padded(2, 5))
    (grad,) = torch.autograd.grad(loss, c)
    return float(loss.detach()), grad


def test_a_class_without_keys_is_registered_under_its_path_and_computes(experiment):
    path = f"{experiment}:DoubleGpg"
    assert load_loss_config({"policy_objective": path}).policy_objective == path
    loss, grad = _loss_and_grad(path)
    gpg_loss, gpg_grad = _loss_and_grad("gpg")
    assert loss == pytest.approx(2.0 * gpg_loss, rel=1e-14) and torch.allclose(grad, 2.0 * gpg_grad, rtol=1e-14)
    assert load_loss_config(load_loss_config({"policy_objective": path}).model_dump()).policy_objective == path


def test_a_registered_class_resolves_to_its_name():
    path = "nemo_is_plugin.loss.objectives.gpg:Gpg"
    assert load_loss_config({"policy_objective": path}).policy_objective == "gpg"


@pytest.mark.parametrize(
    "attribute, says",
    [
        ("WithKeys", "declares keys of its own (keys), which the config, built once at its first use, cannot add: "
         "name its module in the entry-point group 'nemo_is_plugin.objectives'"),
        ("Missing", "'my_experiment' has no attribute 'Missing'"),
        ("NOT_AN_OBJECTIVE", "is 3, not a subclass of nemo_is_plugin.objectives.PolicyObjective"),
    ],
)  # fmt: skip
def test_a_class_that_cannot_be_used_is_refused_in_one_line(experiment, attribute, says):
    with pytest.raises(ConfigError) as err:
        load_loss_config({"policy_objective": f"{experiment}:{attribute}"})
    (line,) = [ln for ln in str(err.value).splitlines() if "policy_objective=" in ln]
    assert says in line


def test_a_module_that_fails_to_import_is_one_line_naming_it():
    with pytest.raises(ConfigError) as err:
        load_loss_config({"policy_objective": "no_such_package.objectives:Mine"})
    (line,) = [ln for ln in str(err.value).splitlines() if "policy_objective=" in ln]
    assert (
        "importing 'no_such_package.objectives' failed (ModuleNotFoundError: No module named 'no_such_package')" in line
    )
    assert "PYTHONPATH" in line
