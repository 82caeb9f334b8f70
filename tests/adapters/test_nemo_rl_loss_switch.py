"""The start-up hook's ``loss_fn.name`` switch (adapters/nemo_rl/startup/loss_switch.py) on a stand-in of NeMo-RL's
loss module: which object NeMo-RL's class builds, what stays NeMo-RL's, and where an ignored name is reported.
NeMo-RL's own ``grpo.setup`` with the switch: functional_tests/test_nemo_rl_config_switch.py."""

from __future__ import annotations

import pickle
import sys
import types

import pytest
from typer.testing import CliRunner

from adapters.nemo_rl_host import HostLossConfig as _Config  # NeMo-RL's config model: extra keys are attributes
from nemo_is_plugin.adapters.nemo_rl import NeMoRLLossFn
from nemo_is_plugin.adapters.nemo_rl.startup import loss_switch
from nemo_is_plugin.apps.cli.main import app


class ClippedPGLossFn:  # the shape of NeMo-RL's: __init__(cfg, use_fused_linear_logprobs=False), no __new__
    def __init__(self, cfg, use_fused_linear_logprobs: bool = False):
        self.ratio_clip_max, self.use_fused_linear_logprobs = cfg.ratio_clip_max, use_fused_linear_logprobs


class Subclass(ClippedPGLossFn):
    pass


@pytest.fixture()
def module():
    saved = ClippedPGLossFn.__dict__.get("__new__")
    mod = types.ModuleType(loss_switch.TARGET_MODULE)
    mod.ClippedPGLossFn = ClippedPGLossFn
    loss_switch.patch(mod)
    loss_switch.patch(mod)  # a second registration patches nothing twice
    yield mod
    if saved is None:
        del ClippedPGLossFn.__new__


def test_a_config_naming_the_plugin_builds_the_plugins_loss(module):
    built = ClippedPGLossFn(_Config(name="nemo_is.clipped_pg", ratio_clip_max=0.28), use_fused_linear_logprobs=True)
    assert type(built) is NeMoRLLossFn and built.use_fused_linear_logprobs
    assert built.ratio_clip_max == 0.28 and built.config.ratio_clip_max == 0.28
    assert type(ClippedPGLossFn({"name": "nemo_is.clipped_pg"})) is NeMoRLLossFn  # a mapping too


@pytest.mark.parametrize("cfg", [_Config(ratio_clip_max=0.3), _Config(name="grpo", ratio_clip_max=0.3)])
def test_any_other_config_builds_nemo_rls_object_unchanged(module, cfg):
    built = ClippedPGLossFn(cfg)
    assert type(built) is ClippedPGLossFn and built.ratio_clip_max == 0.3 and not built.use_fused_linear_logprobs
    again = pickle.loads(pickle.dumps(built))  # as Ray ships it: __new__ without arguments
    assert type(again) is ClippedPGLossFn and again.__dict__ == built.__dict__
    assert isinstance(built, ClippedPGLossFn)


def test_a_subclass_of_nemo_rls_class_is_left_to_nemo_rl(module):
    built = Subclass(_Config(name="nemo_is.clipped_pg", ratio_clip_max=0.2))
    assert type(built) is Subclass and built.ratio_clip_max == 0.2


def test_a_plugin_name_that_is_not_registered_is_refused_naming_it(module):
    with pytest.raises(ValueError, match="nemo_is.clipped_pgg"):
        ClippedPGLossFn(_Config(name="nemo_is.clipped_pgg"))


def test_a_nemo_rl_without_the_class_is_left_alone():
    mod = types.ModuleType(loss_switch.TARGET_MODULE)
    loss_switch.patch(mod)  # no ClippedPGLossFn: nothing to do, and no error breaks NeMo-RL's import
    assert not hasattr(mod, "ClippedPGLossFn")


@pytest.fixture()
def nemo_rl_installed_without_the_hook(tmp_path, monkeypatch):
    (tmp_path / "nemo_rl").mkdir()
    (tmp_path / "nemo_rl" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "_nemo_is_after_import_callbacks", {}, raising=False)  # the hook did not run here
    monkeypatch.delitem(sys.modules, loss_switch.TARGET_MODULE, raising=False)


def test_validate_stops_on_a_name_nemo_rl_would_ignore_here(nemo_rl_installed_without_the_hook, tmp_path):
    recipe = tmp_path / "grpo.yaml"
    section = "  use_importance_sampling_correction: true\n  is_correction_level: sequence_mean\n"
    recipe.write_text("grpo: {}\nloss_fn:\n  name: nemo_is.clipped_pg\n" + section)
    result = CliRunner().invoke(app, ["validate", str(recipe)], env={"COLUMNS": "400"})
    assert result.exit_code == 2
    assert "NeMo-RL in this interpreter would build its own ClippedPGLossFn and ignore it" in result.output
    assert "head_check nemo-rl-loss" in result.output
    recipe.write_text("grpo: {}\nloss_fn:\n" + section)  # no name: nothing to ignore
    assert CliRunner().invoke(app, ["validate", str(recipe), "--allow-unknown-keys"]).exit_code == 0


def test_with_the_switch_registered_validate_accepts_the_name(nemo_rl_installed_without_the_hook, tmp_path):
    sys._nemo_is_after_import_callbacks[loss_switch.TARGET_MODULE] = {loss_switch.HOOK_KEY: loss_switch.patch}
    assert loss_switch.ignored_name_message("nemo_is.clipped_pg") is None
    recipe = tmp_path / "grpo.yaml"
    recipe.write_text("loss_fn:\n  name: nemo_is.clipped_pg\n")
    assert CliRunner().invoke(app, ["validate", str(recipe)]).exit_code == 0
