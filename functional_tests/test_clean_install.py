"""`pip install .` in a clean virtual environment, as a trainer installs the plugin: no demo or command-line stack and
no megatron-core come with it, every module a trainer imports imports, the loss and its gradient, the kernels'
log-probs and the verl adapter's loss equal float64 references there, and what needs an extra (each app, megatron-core's
groups for groups="parallel_state", slime's entry points) says which extra in one line.

The environment gets torch first, pinned as in requirements/ci.lock (a trainer brings its own torch; here that is the
local CPU wheel, ~20-45 s), then the plugin from a copy of the source tree (so the build leaves nothing in the
checkout) with the lock as constraints, so that its dependencies resolve to the versions CI tests. ~1 min in all.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LOCK = REPO / "requirements" / "ci.lock"
CHECK = Path(__file__).resolve().parent / "_clean_install_check.py"
# The extra each top-level module comes with (pyproject.toml's optional dependencies).
EXTRA_OF = {"ray": "demo", "matplotlib": "cli", "typer": "cli", "rich": "cli", "pyarrow": "cli", "megatron": "megatron"}
APP_EXTRAS = {"cli": "cli", "compat": "cli", "demo": "demo", "diagnose": "cli", "evidence": "cli", "bench": "cli"}


def _run(cmd: list, **kwargs) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=600, **kwargs)
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc


def _clean_env() -> dict:
    """This process's environment without what would let the venv see the checkout or the test environment."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    return dict(env, OMP_NUM_THREADS="1", PIP_DISABLE_PIP_VERSION_CHECK="1")


@pytest.fixture(scope="module")
def clean_venv(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("clean-install")
    src = root / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "setup.py"):  # setup.py: the start-up hook's .pth
        shutil.copy2(REPO / name, src / name)
    # symlinks=False: the wheel carries demo/configs, a link to configs/demo, as files
    shutil.copytree(REPO / "nemo_is_plugin", src / "nemo_is_plugin", ignore=shutil.ignore_patterns("__pycache__"))
    venv = root / "venv"
    env = _clean_env()
    _run([sys.executable, "-m", "venv", venv], env=env, cwd=root)
    py = venv / "bin" / "python"
    torch_pin = re.search(r"^torch==\S+$", LOCK.read_text(), re.M).group(0)
    _run([py, "-m", "pip", "install", "-q", torch_pin], env=env, cwd=root)
    _run([py, "-m", "pip", "install", "-q", "-c", LOCK, src], env=env, cwd=root)
    return venv


@pytest.fixture(scope="module")
def report(clean_venv) -> dict:
    proc = _run([clean_venv / "bin" / "python", CHECK], env=_clean_env(), cwd=clean_venv.parent)
    return json.loads(proc.stdout)


def test_the_install_brings_no_demo_or_command_line_stack(report):
    installed = [f"{m} (the [{EXTRA_OF[m]}] extra's)" for m, present in report["installed"].items() if present]
    assert not installed, f"pip install . installed {installed}: move it out of [project] dependencies"
    assert set(report["installed"]) == set(EXTRA_OF)  # megatron-core among the modules checked absent
    assert report["imported_extras"] == []


def test_the_venv_runs_the_installed_copy_not_the_checkout(report, clean_venv):
    assert Path(report["plugin_file"]).is_relative_to(clean_venv)


def test_the_rollout_dump_hook_writes_one_line_per_response(report):
    assert report["dumped"] == 3


def test_every_module_imports_or_needs_only_an_extra(report):
    """A module-level import of a package outside the core dependencies shows here as a failure to import."""
    broken = {name: why for name, why in report["import_failures"].items() if not why.startswith("optional:")}
    assert not broken, "\n\n".join(f"{name}:\n{why}" for name, why in broken.items())
    # the command line needs its extra: the cli modules are the ones that fail, for typer
    assert report["import_failures"].get("nemo_is_plugin.apps.cli.main") == "optional:typer"


@pytest.mark.parametrize("case", ["ppo", "token_tis"])
def test_the_loss_and_its_gradient_equal_the_float64_reference(report, case):
    got = report["cases"][case]
    assert got["clip_fraction"] > 0  # the case exercises the PPO clip
    assert (got["is_truncated_fraction"] > 0) == (case == "token_tis")  # and, for TIS, the truncation
    assert got["loss"] == pytest.approx(got["reference"], rel=1e-12)
    assert got["grad"] == pytest.approx(got["reference_grad"], rel=1e-10, abs=1e-14)
    assert max(map(abs, got["grad"])) > 1e-3


def test_the_kernels_compute_without_megatron_core(report):
    """Chunked log-probs and entropy from logits, and log-probs from hidden states + the LM-head weight (fp32), equal
    float64 log_softmax."""
    got = report["kernels"]
    assert got["scale"] > 1
    assert max(got["vocab_parallel"], got["entropy"], got["fused_linear"]) < 1e-5 * got["scale"]


def test_the_verl_adapter_computes_without_verl_or_megatron_core(report):
    got = report["verl"]
    assert got["loss"] == pytest.approx(got["reference"], rel=1e-12)
    assert got["grad_error"] <= 1e-12 * got["grad_scale"] and got["grad_scale"] > 1e-3


@pytest.mark.parametrize("app", sorted(APP_EXTRAS))
def test_each_app_names_its_extra(report, app):
    """The apps import only with their extra: the import raises an ImportError whose message names it."""
    extra = APP_EXTRAS[app]
    error = report["extra_errors"][f"apps.{app}"]
    assert error["type"] == "MissingExtraError"
    assert error["message"].startswith(f"nemo_is_plugin.apps.{app} needs the '{extra}' extra (")
    assert error["message"].endswith(f"not installed): pip install 'nemo-is-plugin[{extra}]'")


@pytest.mark.parametrize("where", ["parallel_state", "slime"])
def test_megatron_core_groups_name_the_megatron_extra(report, where):
    """groups="parallel_state" (ParallelGroups.from_parallel_state; slime's entry points' default) without
    megatron-core: a one-line ImportError naming the `megatron` extra, not a bare ModuleNotFoundError."""
    error = report["extra_errors"][where]
    assert error["type"] == "MissingExtraError"
    assert error["message"] == (
        "groups='parallel_state' (megatron-core's parallel_state groups) needs the 'megatron' extra (megatron not "
        "installed): pip install 'nemo-is-plugin[megatron]'"
    )


def test_the_console_script_names_the_missing_extra(clean_venv):
    proc = subprocess.run(
        [str(clean_venv / "bin" / "nemo-is"), "--version"],
        capture_output=True,
        text=True,
        env=_clean_env(),
        timeout=120,
    )
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip() == (
        "nemo-is needs typer, which is not installed: install nemo-is-plugin[cli] (pip install 'nemo-is-plugin[cli]')"
    )
