"""The plugin on from NeMo-RL's config alone: ``loss_fn.name: nemo_is.clipped_pg`` makes NeMo-RL's own GRPO ``setup``
build the plugin's loss, with no edit of NeMo-RL (functional_tests/_nemo_rl_setup.py runs ``setup`` up to its cluster
section in a fresh interpreter; NeMo-RL is the pinned source, NVIDIA-NeMo/RL @7ea279ab).

Interpreters, each started as NeMo-RL starts its driver and its Ray workers (the driver's environment):
- the hook folder on ``PYTHONPATH`` (docs/nemo_rl.md, way 1);
- a scratch environment with the plugin installed by ``pip install`` (wheel and ``-e``), no repository on the path:
  its ``nemo_is_plugin_startup.pth`` runs the hook (the environment of a worker, or of a driver);
- ``python -S`` (no site, so no hook): the one way the name is ignored, with what ``head_check nemo-rl-loss`` says.
~10 s per interpreter (NeMo-RL's GRPO module imports transformers and Ray).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.worker_result import result_json
from host_shims.nemo_rl import SKIP_REASON, nemo_rl_path
from test_startup_hook_install import _env, _host_site, installed  # noqa: F401  (the scratch-install fixture)

from nemo_is_plugin.adapters.nemo_rl.startup import HOOK_DIR

pytestmark = pytest.mark.skipif(nemo_rl_path() is None, reason=SKIP_REASON)

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "functional_tests" / "_nemo_rl_setup.py"
PLUGIN_LOSS = "nemo_is_plugin.adapters.nemo_rl.loss_fn.NeMoRLLossFn"
NEMO_RL_LOSS = "nemo_rl.algorithms.loss.loss_functions.ClippedPGLossFn"
# NeMo-RL's keys (GRPO with TIS) and, beside them, the plugin's: its name and one of its own keys
NEMO_RL_KEYS = {
    "reference_policy_kl_penalty": 0.01,
    "use_importance_sampling_correction": True,
    "truncated_importance_sampling_type": "tis",
    "truncated_importance_sampling_ratio": 2.0,
}
NAMED = {"name": "nemo_is.clipped_pg", **NEMO_RL_KEYS, "is_correction_level": "sequence_mean"}


def _paths(*extra: str) -> list[str]:
    return [*extra, str(ROOT / "functional_tests"), str(ROOT / "tests"), str(nemo_rl_path())]


def _setup(python, section: dict, tmp_path: Path, paths: list[str], *flags: str, **env: str) -> dict:
    cmd = [str(python), *flags, str(SCRIPT), str(tmp_path), json.dumps(section), *paths]
    proc = subprocess.run(cmd, cwd=tmp_path, env=_env(**env), capture_output=True, text=True, timeout=600)
    return result_json(proc)


def _assert_plugin_everywhere(out: dict) -> None:
    assert out["built"] == out["single_controller"] == out["ppo"] == out["unpickled"] == PLUGIN_LOSS
    assert out["same_class_everywhere"]  # the three setups build with the one class the switch patches
    assert out["loss"] == out["plugin_loss"]  # the plugin's value: sequence_mean IS ...
    assert abs(out["loss"] - out["nemo_rl_loss"]) > 1e-3  # ... not NeMo-RL's token-level IS


def test_the_name_in_loss_fn_makes_grpo_setup_build_the_plugins_loss(tmp_path):
    out = _setup(sys.executable, NAMED, tmp_path, _paths(str(ROOT)), PYTHONPATH=HOOK_DIR)
    _assert_plugin_everywhere(out)
    assert Path(out["plugin_file"]).is_relative_to(ROOT)


def test_without_the_name_nemo_rl_builds_its_own_loss_and_never_imports_the_plugin(tmp_path):
    out = _setup(
        sys.executable,
        {**NEMO_RL_KEYS, "is_correction_level": "sequence_mean"},
        tmp_path,
        _paths(str(ROOT)),
        PYTHONPATH=HOOK_DIR,
    )
    assert out["built"] == out["single_controller"] == out["ppo"] == out["unpickled"] == NEMO_RL_LOSS
    assert not out["plugin_imported"]  # NeMo-RL's setup ran without importing the plugin
    assert out["loss"] == out["nemo_rl_loss"]  # the plugin's key, unnamed, is NeMo-RL's extra key: ignored


def test_an_installed_plugin_switches_nemo_rl_from_its_config_in_a_clean_interpreter(installed, tmp_path):  # noqa: F811
    how, python, site = installed
    out = _setup(python, NAMED, tmp_path, _paths(), PYTHONPATH="")
    _assert_plugin_everywhere(out)
    assert Path(out["plugin_file"]).is_relative_to(site if how == "wheel" else site.parents[3] / "src")


def test_where_no_hook_runs_the_name_is_ignored_and_head_check_says_so(installed, tmp_path):  # noqa: F811
    """``python -S``: nothing of the plugin runs when NeMo-RL builds its loss, so NeMo-RL's own is built; the check a
    user runs in that interpreter reports it (exit status 1)."""
    how, python, site = installed
    plugin = [str(site)] if how == "wheel" else [str(site.parents[3] / "src")]
    out = _setup(python, NAMED, tmp_path, _paths(*plugin, _host_site()), "-S")
    assert out["built"] == NEMO_RL_LOSS and out["loss"] == out["nemo_rl_loss"]
    code = (
        f"import sys; sys.path[:0] = {_paths(*plugin, _host_site())!r}\n"
        "from host_shims import nemo_rl_setup; nemo_rl_setup.install()  # NeMo-RL's imports, as in _nemo_rl_setup.py\n"
        "from nemo_is_plugin.adapters.head_check import main; sys.exit(main(['nemo-rl-loss']))"
    )
    off = subprocess.run([str(python), "-S", "-c", code], cwd=tmp_path, env=_env(), capture_output=True, text=True)
    assert off.returncode == 1, off.stdout + off.stderr
    assert "[FAIL] loss_fn.name switch registered in this interpreter: False" in off.stdout
    assert f"[FAIL] NeMo-RL's ClippedPGLossFn builds {NEMO_RL_LOSS}" in off.stdout
    on = subprocess.run([str(python), "-c", code], cwd=tmp_path, env=_env(), capture_output=True, text=True)
    assert on.returncode == 0, on.stdout + on.stderr
    assert f"[ok] NeMo-RL's ClippedPGLossFn builds {PLUGIN_LOSS}" in on.stdout
