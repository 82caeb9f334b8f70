"""The NeMo-RL start-up hook from an installed plugin: ``pip install`` puts ``nemo_is_plugin_startup.pth`` at the root
of site-packages (setup.py), and site.py runs its line in every interpreter of that environment -- with no repository
on ``PYTHONPATH``, with another ``sitecustomize`` first on ``sys.path``, and under ``python -I``.

Two scratch environments, each a venv whose site holds one ``.pth`` path line naming the test environment's
site-packages (torch; test_worker_env.py's worker interpreter: the ``.pth`` files there, the plugin's editable install
among them, are not run), with the plugin installed from a copy of the source tree (the build leaves nothing in the
checkout) by ``pip install --no-deps --no-build-isolation``: once as a wheel, once editable (``-e``). NeMo-RL is the
stand-in tree of ``tests/helpers/fake_nemo_rl_head.py``, the worker code test_host_head_workers.py's. Where the hook
cannot run (``python -S``), the plugin's NeMo-RL loss stops the run at its first call, in one line naming the cause and
the fix. ~1 s per install, ~3 s per worker interpreter: ~30 s in all (75 s on a loaded 2-core machine).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from helpers.fake_nemo_rl_head import FIRST_LOGPROB_PASS, write_fake_nemo_rl
from helpers.worker_result import result_text

ROOT = Path(__file__).resolve().parents[1]
PTH = "nemo_is_plugin_startup.pth"
LOSS_MODULE, HEAD_MODULE = "nemo_rl.algorithms.loss.loss_functions", "nemo_rl.distributed.model_utils"
WORKER = (
    textwrap.dedent("""
    import json, sys
    sys.path.insert(0, sys.argv[1])  # the NeMo-RL tree (python -I ignores PYTHONPATH)
    at_start = {"plugin": "nemo_is_plugin" in sys.modules, "torch": "torch" in sys.modules}
    hooks = sorted(getattr(sys, "_nemo_is_after_import_callbacks", {}))  # the .pth line's only effect
""")
    + FIRST_LOGPROB_PASS
    + textwrap.dedent("""
    import nemo_is_plugin
    print("RESULT " + json.dumps({
        "at_start": at_start,
        "hooks": hooks,
        "plugin_head": bool(getattr(fn, "nemo_is_head", False)),
        "plugin_file": nemo_is_plugin.__file__,
        "sys_path": sys.path,
        "flags": {"isolated": sys.flags.isolated, "no_site": sys.flags.no_site},
        "max_abs_diff": float((first - want).abs().max()),
    }))
""")
)
# python -S: no site, so no .pth: the worker reaches its packages by hand, and the plugin's loss is then called
LOSS_WORKER = textwrap.dedent("""
    import sys
    sys.path[:0] = sys.argv[1:]
    import nemo_rl.distributed.model_utils
    import torch
    from nemo_is_plugin.adapters.nemo_rl import NeMoRLLossFn
    loss_fn = NeMoRLLossFn({"use_importance_sampling_correction": True, "is_correction_level": "sequence_mean",
                            "reference_policy_kl_penalty": 0.0})
    g = torch.Generator().manual_seed(0)
    data = {"token_mask": torch.ones(2, 6), "sample_mask": torch.ones(2), "advantages": torch.randn(2, 6, generator=g),
            "prev_logprobs": -torch.rand(2, 6, generator=g), "generation_logprobs": -torch.rand(2, 6, generator=g)}
    counts = dict(global_valid_seqs=torch.tensor(2.0), global_valid_toks=torch.tensor(10.0))
    try:
        loss_fn(next_token_logprobs=-torch.rand(2, 5, generator=g), data=data, **counts)
        print("RESULT ran")
    except Exception as exc:
        print(f"RESULT stopped {type(exc).__name__}: {exc}")
""")


def _env(**extra: str) -> dict[str, str]:
    drop = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "NEMO_IS_NEMO_RL_HEAD")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    return dict(env, OMP_NUM_THREADS="1", PIP_DISABLE_PIP_VERSION_CHECK="1", **extra)


def _run(cmd: list, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def _site(python: Path) -> Path:
    code = "import site; print(site.getsitepackages()[0])"
    return Path(_run([python, "-c", code], python.parent, _env()).stdout.strip())


def _host_site() -> str:
    import torch

    return str(Path(torch.__file__).resolve().parents[1])


@pytest.fixture(scope="module", params=["wheel", "editable"])
def installed(request, tmp_path_factory) -> tuple[str, Path, Path]:
    """(how, the venv's python, its site-packages) with the plugin installed from a copy of the source tree."""
    root = tmp_path_factory.mktemp(f"hook-install-{request.param}")
    src = root / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "setup.py"):
        shutil.copy2(ROOT / name, src / name)
    shutil.copytree(ROOT / "nemo_is_plugin", src / "nemo_is_plugin", ignore=shutil.ignore_patterns("__pycache__"))
    venv = root / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", venv], root, _env()).check_returncode()
    python = venv / "bin" / "python"
    site = _site(python)
    (site / "host_packages.pth").write_text(_host_site() + "\n")  # torch, setuptools and pip: not the plugin
    editable = ["-e"] if request.param == "editable" else []
    # --ignore-installed: pip sees the test environment's own (editable) nemo-is-plugin through that path line and
    # must neither count it as installed nor try to remove it
    pip = [
        python,
        "-m",
        "pip",
        "install",
        "-q",
        "--no-deps",
        "--no-build-isolation",
        "--no-index",
        "--ignore-installed",
    ]
    proc = _run([*pip, *editable, f"./{src.name}"], root, _env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return request.param, python, site


@pytest.fixture(scope="module")
def nemo_rl_tree(tmp_path_factory) -> Path:
    return write_fake_nemo_rl(tmp_path_factory.mktemp("hook-install-nemo-rl") / "checkout")


def _worker(python: Path, tree: Path, cwd: Path, *flags: str, **env: str) -> dict:
    return json.loads(result_text(_run([python, *flags, "-c", WORKER, tree], cwd, _env(**env))))


def test_the_install_puts_the_startup_pth_at_the_root_of_site_packages(installed):
    how, python, site = installed
    installed_pth = (site / PTH).read_text()
    assert installed_pth == (ROOT / "nemo_is_plugin" / "adapters" / "nemo_rl" / "startup" / PTH).read_text()
    assert (site / "nemo_is_plugin").is_dir() == (how == "wheel")  # editable: the source copy is used in place


def test_the_installed_hook_puts_the_plugin_head_under_nemo_rl_without_pythonpath(installed, nemo_rl_tree, tmp_path):
    how, python, site = installed
    out = _worker(python, nemo_rl_tree, tmp_path, NEMO_IS_NEMO_RL_HEAD="1")
    assert out["at_start"] == {"plugin": False, "torch": False}  # the .pth line imports neither
    assert out["hooks"] == [LOSS_MODULE, HEAD_MODULE]
    assert out["plugin_head"] and out["max_abs_diff"] < 1e-12  # NeMo-RL's values, from the plugin's head
    assert Path(out["plugin_file"]).is_relative_to(site if how == "wheel" else site.parents[3] / "src")
    assert not any(Path(p).resolve() == ROOT for p in out["sys_path"] if p)  # no repository on the path ("": cwd)

    off = _worker(python, nemo_rl_tree, tmp_path, NEMO_IS_NEMO_RL_HEAD="0")
    assert not off["plugin_head"] and off["max_abs_diff"] == 0.0  # switched off: NeMo-RL's own head
    assert off["at_start"] == {"plugin": False, "torch": False}  # and nothing imported: the loss_fn.name switch alone
    assert off["hooks"] == [LOSS_MODULE]  # (functional_tests/test_nemo_rl_config_switch.py)


def test_another_sitecustomize_first_on_the_path_leaves_the_installed_hook_running(installed, nemo_rl_tree, tmp_path):
    _, python, _ = installed
    other = tmp_path / "other"
    other.mkdir()
    (other / "sitecustomize.py").write_text("print('OTHER SITECUSTOMIZE RAN')\n")
    env = _env(PYTHONPATH=str(other), NEMO_IS_NEMO_RL_HEAD="1")
    proc = _run([python, "-c", WORKER, nemo_rl_tree], tmp_path, env)
    assert "OTHER SITECUSTOMIZE RAN" in proc.stdout  # Python ran that one, not the plugin's
    out = json.loads(result_text(proc))
    assert out["plugin_head"] and out["max_abs_diff"] < 1e-12


def test_the_installed_hook_runs_under_python_isolated_mode(installed, nemo_rl_tree, tmp_path):
    _, python, _ = installed
    out = _worker(python, nemo_rl_tree, tmp_path, "-I", NEMO_IS_NEMO_RL_HEAD="1")
    assert out["flags"] == {"isolated": 1, "no_site": 0}
    assert out["plugin_head"] and out["max_abs_diff"] < 1e-12


def test_where_the_hook_cannot_run_the_plugins_loss_stops_at_its_first_call(installed, nemo_rl_tree, tmp_path):
    """``python -S`` runs no .pth: with the switch on, NeMo-RL's own head is in place and the loss says so."""
    _, python, site = installed
    paths = [str(nemo_rl_tree), str(site), _host_site()]
    if installed[0] == "editable":
        paths.insert(1, str(site.parents[3] / "src"))
    on = result_text(_run([python, "-S", "-c", LOSS_WORKER, *paths], tmp_path, _env(NEMO_IS_NEMO_RL_HEAD="1")))
    assert on.startswith("stopped SwitchNotInEffectError: NEMO_IS_NEMO_RL_HEAD=1 but NeMo-RL's ")
    assert "\n" not in on and "start-up hook did not run" in on and "install the plugin in the workers'" in on
    off = result_text(_run([python, "-S", "-c", LOSS_WORKER, *paths], tmp_path, _env()))
    assert off == "ran"
