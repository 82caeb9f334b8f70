"""The host heads reach the hosts' worker processes: interpreters that do not import the plugin by themselves.

The worker interpreter is test_worker_env.py's: a fresh venv (``--without-pip``) whose only site entry names the test
environment's site-packages (torch, pydantic, ray, verl), which does not make the plugin importable. NeMo-RL is the
stand-in tree of ``tests/helpers/fake_nemo_rl_head.py`` (its ``model_utils`` is the project's model of NeMo-RL's fused
head and of the fused forward that calls it by name), put on the worker's ``PYTHONPATH`` as a NeMo-RL checkout is.

- NeMo-RL, set up as docs/nemo_rl.md says (the plugin's source directory on ``PYTHONPATH`` and
  ``NEMO_IS_NEMO_RL_HEAD=1``, both forwarded by NeMo-RL from the driver's environment): at start-up the plugin is not
  imported (nor torch); the import of NeMo-RL's module installs the plugin's head before any call, and the first call
  of NeMo-RL's fused forward runs on it and returns NeMo-RL's values. Without the switch NeMo-RL's own function runs and
  the plugin is never imported; with the switch but no importable plugin the import of NeMo-RL's module fails; the
  ``sitecustomize`` the hook shadows still runs. The same in a Ray actor started on that interpreter with NeMo-RL's
  kind of runtime environment (``py_executable`` + the driver's environment variables). The hook's own folder, which
  holds the hook alone, in place of the repository root: the plugin imports from the tree around it, nothing else of
  the repository does.
- verl: ``import verl`` in the worker loads the entry point, which registers the head's hooks, and verl's own
  ``HFModelConfig`` built there reads ``fused_kernel_options.impl_backend`` (``nemo_is`` without
  ``use_fused_kernels`` is refused).
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
from helpers.worker_result import result_json
from test_worker_env import worker_python  # noqa: F401  (the module-scoped fixture: a venv without the plugin)

ROOT = Path(__file__).resolve().parents[1]
HOOK_DIR = ROOT / "nemo_is_plugin" / "adapters" / "nemo_rl" / "startup" / "hook"  # the hook alone
NEMO_RL_WORKER = (
    textwrap.dedent("""
    import json, sys
    at_start = {"plugin": "nemo_is_plugin" in sys.modules, "torch": "torch" in sys.modules}
""")
    + FIRST_LOGPROB_PASS
    + textwrap.dedent("""
    print("RESULT " + json.dumps({
        "at_start": at_start,
        "plugin_head": bool(getattr(fn, "nemo_is_head", False)),
        "plugin_imported": "nemo_is_plugin" in sys.modules,
        "python": sys.executable,
        "max_abs_diff": float((first - want).abs().max()),
    }))
""")
)


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "NEMO_IS_NEMO_RL_HEAD")}
    return dict(env, OMP_NUM_THREADS="1", **extra)


def _run(python: Path, code: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([str(python), "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=240)


@pytest.fixture
def nemo_rl_tree(tmp_path) -> Path:
    return write_fake_nemo_rl(tmp_path / "nemo_rl_checkout")


def test_the_switch_puts_the_plugin_head_under_nemo_rl_before_its_first_call(worker_python, nemo_rl_tree, tmp_path):  # noqa: F811
    shadowed = tmp_path / "shadowed"
    shadowed.mkdir()
    (shadowed / "sitecustomize.py").write_text("print('SHADOWED SITECUSTOMIZE RAN')\n")
    pythonpath = os.pathsep.join([str(ROOT), str(nemo_rl_tree), str(shadowed)])
    out = result_json(
        _run(worker_python, NEMO_RL_WORKER, tmp_path, _env(PYTHONPATH=pythonpath, NEMO_IS_NEMO_RL_HEAD="1"))
    )
    assert out["python"] == str(worker_python)
    assert out["at_start"] == {"plugin": False, "torch": False}  # the start-up hook imports neither
    assert out["plugin_head"] and out["plugin_imported"]
    assert out["max_abs_diff"] < 1e-12  # NeMo-RL's values, from the plugin's head

    proc = _run(worker_python, NEMO_RL_WORKER, tmp_path, _env(PYTHONPATH=pythonpath))
    off = result_json(proc)
    assert not off["plugin_head"] and not off["plugin_imported"] and off["max_abs_diff"] == 0.0
    assert "SHADOWED SITECUSTOMIZE RAN" in proc.stdout  # the hook runs the sitecustomize it shadows


def test_the_hook_folder_alone_runs_the_hook_and_adds_only_the_plugin(worker_python, nemo_rl_tree, tmp_path):  # noqa: F811
    """docs/nemo_rl.md's recommended setup from a source tree: the hook's folder, which holds the hook alone, on
    PYTHONPATH instead of the repository root. The plugin imports from the tree around the hook; nothing else of the
    repository (tools/, scripts/, conftest.py) does."""
    assert sorted(p.name for p in HOOK_DIR.iterdir() if p.name != "__pycache__") == ["sitecustomize.py"]
    probe = textwrap.dedent("""
        import importlib.util, json, sys
        def imports(name):  # where the module would come from (another package may have the same top-level name)
            spec = importlib.util.find_spec(name)
            return [] if spec is None else [spec.origin or "", *(spec.submodule_search_locations or [])]
        import nemo_is_plugin.adapters.nemo_rl as adapter
        print("RESULT " + json.dumps({"plugin": adapter.__file__, "loss": hasattr(adapter, "NeMoRLLossFn"),
                                      "others": {n: imports(n) for n in ("tools", "conftest", "scripts")}}))
    """)
    for switch in ("1", "0"):
        env = _env(PYTHONPATH=os.pathsep.join([str(HOOK_DIR), str(nemo_rl_tree)]), NEMO_IS_NEMO_RL_HEAD=switch)
        out = result_json(_run(worker_python, NEMO_RL_WORKER, tmp_path, env))
        assert out["at_start"] == {"plugin": False, "torch": False}
        assert out["plugin_head"] == (switch == "1")
        assert out["max_abs_diff"] < 1e-12 if switch == "1" else out["max_abs_diff"] == 0.0
        found = result_json(_run(worker_python, probe, tmp_path, env))
        assert Path(found["plugin"]).is_relative_to(ROOT) and found["loss"]  # the plugin's loss unpickles here
        # the repository's own (a package of the same top-level name installed in the venv, even one living under
        # the checkout, is not what the repository root on PYTHONPATH would have added)
        repo_own = {ROOT / "tools", ROOT / "tools" / "__init__.py", ROOT / "conftest.py", ROOT / "scripts"}
        from_repo = {n: [p for p in where if p and Path(p) in repo_own] for n, where in found["others"].items()}
        assert from_repo == {"tools": [], "conftest": [], "scripts": []}


def test_the_switch_without_an_importable_plugin_fails_nemo_rl_import(worker_python, nemo_rl_tree, tmp_path):  # noqa: F811
    """The hook's folder copied without the package around it: NeMo-RL's import fails, naming the cause."""
    copy = tmp_path / "copy" / "nemo_is_plugin" / "adapters"
    shutil.copytree(HOOK_DIR, copy / "nemo_rl" / "startup" / "hook")
    shutil.copy2(ROOT / "nemo_is_plugin" / "adapters" / "import_hooks.py", copy / "import_hooks.py")
    pythonpath = os.pathsep.join([str(copy / "nemo_rl" / "startup" / "hook"), str(nemo_rl_tree)])
    proc = _run(worker_python, NEMO_RL_WORKER, tmp_path, _env(PYTHONPATH=pythonpath, NEMO_IS_NEMO_RL_HEAD="1"))
    assert proc.returncode != 0 and "RESULT" not in proc.stdout
    assert "NEMO_IS_NEMO_RL_HEAD=1 asks for the plugin's head in nemo_rl.distributed.model_utils" in proc.stderr
    assert "No module named 'nemo_is_plugin'" in proc.stderr


RAY_DRIVER = textwrap.dedent("""
    import json, os, sys
    worker_python, pythonpath, worker_code = sys.argv[1], sys.argv[2], sys.argv[3]
    import ray

    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)

    @ray.remote(num_cpus=0)
    class MegatronPolicyWorker:
        def run(self, code):
            import contextlib, io
            buf = io.StringIO()
            with contextlib.redirect_stdout(buf):
                exec(code, {"__name__": "__worker__"})
            return buf.getvalue()

    out = {}
    for name, switch in (("switched_on", "1"), ("switched_off", "0")):
        env_vars = dict(os.environ, PYTHONPATH=pythonpath, NEMO_IS_NEMO_RL_HEAD=switch)  # as NeMo-RL forwards them
        runtime_env = {"py_executable": worker_python, "env_vars": env_vars}
        worker = MegatronPolicyWorker.options(runtime_env=runtime_env).remote()
        text = ray.get(worker.run.remote(worker_code))
        out[name] = json.loads([l for l in text.splitlines() if l.startswith("RESULT ")][-1][7:])
    ray.shutdown()
    print("RESULT " + json.dumps(out))
""")


@pytest.mark.timeout(420)
def test_the_switch_reaches_a_ray_actor_on_the_worker_interpreter(worker_python, nemo_rl_tree, tmp_path):  # noqa: F811
    pytest.importorskip("ray", reason="Ray is the demo extra")
    script = tmp_path / "driver.py"
    script.write_text(RAY_DRIVER)
    pythonpath = os.pathsep.join([str(ROOT), str(nemo_rl_tree)])
    env = _env(RAY_DISABLE_IMPORT_WARNING="1")
    proc = subprocess.run(
        [sys.executable, str(script), str(worker_python), pythonpath, NEMO_RL_WORKER],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=360,
    )
    out = result_json(proc)
    on, off = out["switched_on"], out["switched_off"]
    assert on["python"] == off["python"] == str(worker_python)
    assert on["plugin_head"] and on["max_abs_diff"] < 1e-12
    assert not off["plugin_head"] and off["max_abs_diff"] == 0.0


VERL_WORKER = textwrap.dedent("""
    import json, sys
    import verl
    import verl.workers.config.model as model_config
    from verl.workers.config.model import HFModelConfig
    hooks = sorted(getattr(sys, "_nemo_is_after_import_callbacks", {}))
    ok = HFModelConfig(path=sys.argv[1], load_tokenizer=False, use_fused_kernels=True,
                       fused_kernel_options={"impl_backend": "nemo_is"})
    try:
        HFModelConfig(path=sys.argv[1], load_tokenizer=False, fused_kernel_options={"impl_backend": "nemo_is"})
        refused = None
    except ValueError as exc:
        refused = str(exc)
    print("RESULT " + json.dumps({"hooks": hooks, "refused": refused,
                                  "hooked": getattr(HFModelConfig.__post_init__, "nemo_is_hook", False)}))
""")


@pytest.mark.timeout(300)
def test_verl_workers_read_the_switch_from_verl_model_config(worker_python, tmp_path):  # noqa: F811
    pytest.importorskip("verl.workers.config.model", reason="verl is the verl extra")
    hf = tmp_path / "tiny_hf"
    hf.mkdir()
    (hf / "config.json").write_text(
        json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_embd": 16, "n_layer": 1})
    )
    env = _env(PYTHONPATH=str(ROOT))
    env.pop("VERL_USE_EXTERNAL_PLUGINS", None)
    proc = subprocess.run(
        [str(worker_python), "-c", VERL_WORKER, str(hf)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    out = result_json(proc)
    assert out["hooked"]
    assert out["hooks"] == [
        "nemo_rl.algorithms.loss.loss_functions",  # the start-up hook's loss_fn.name switch
        "verl.models.transformers.monkey_patch",  # nemo_is refused on FSDP models (adapters/verl/head.py)
        "verl.workers.config.model",
        "verl.workers.engine.megatron.transformer_impl",
    ]
    assert "also set actor_rollout_ref.model.use_fused_kernels=True" in out["refused"]


@pytest.mark.timeout(300)
def test_the_documented_check_passes_in_a_switched_on_worker_and_fails_otherwise(worker_python, nemo_rl_tree, tmp_path):  # noqa: F811
    """docs/nemo_rl.md's check, run with the worker's interpreter and environment."""
    check = "import sys; from nemo_is_plugin.adapters.head_check import main; sys.exit(main(['nemo-rl']))"
    pythonpath = os.pathsep.join([str(ROOT), str(nemo_rl_tree)])
    on = _run(worker_python, check, tmp_path, _env(PYTHONPATH=pythonpath, NEMO_IS_NEMO_RL_HEAD="1"))
    assert on.returncode == 0, on.stdout + on.stderr[-2000:]
    assert "[ok] start-up hook registered in this interpreter: True" in on.stdout
    assert "is nemo_is_plugin.adapters.nemo_rl.head.from_parallel_hidden_states_to_logprobs" in on.stdout
    assert on.stdout.count("[ok]") == 6 and "[FAIL]" not in on.stdout
    off = _run(worker_python, check, tmp_path, _env(PYTHONPATH=pythonpath))
    assert off.returncode == 1 and "[FAIL] NEMO_IS_NEMO_RL_HEAD=(unset)" in off.stdout
    assert "[ok] log-probs: max relative difference" in off.stdout  # the equivalence holds either way
    # the switch on in a worker the hook never reached (the plugin put on sys.path only after start-up)
    late = f"import sys; sys.path.insert(0, {str(ROOT)!r}); " + check
    no_hook = _run(worker_python, late, tmp_path, _env(PYTHONPATH=str(nemo_rl_tree), NEMO_IS_NEMO_RL_HEAD="1"))
    assert no_hook.returncode == 1, no_hook.stdout + no_hook.stderr[-2000:]
    assert "[FAIL] start-up hook registered in this interpreter: False" in no_hook.stdout
    assert "[FAIL] nemo_rl.distributed.model_utils.from_parallel_hidden_states_to_logprobs is " in no_hook.stdout


@pytest.mark.timeout(300)
def test_the_documented_verl_check_passes_in_a_verl_worker(worker_python, tmp_path):  # noqa: F811
    pytest.importorskip("verl.utils.experimental.torch_functional", reason="verl is the verl extra")
    check = "import sys; from nemo_is_plugin.adapters.head_check import main; sys.exit(main(['verl']))"
    proc = _run(worker_python, check, tmp_path, _env(PYTHONPATH=str(ROOT)))
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
    assert "[ok] the plugin's head against verl's torch op on cpu:" in proc.stdout
    assert "[ok] verl's FSDP fused forwards build FusedLinearForPPO as the plugin expects" in proc.stdout
    assert proc.stdout.count("[ok]") == 8
    # verl told to load no entry point: nothing of the plugin runs in verl's process, and the check says so
    off = _run(worker_python, check, tmp_path, _env(PYTHONPATH=str(ROOT), VERL_USE_EXTERNAL_PLUGINS="none"))
    assert off.returncode == 1 and "[FAIL] hooks registered by the verl.plugins entry point: []" in off.stdout
