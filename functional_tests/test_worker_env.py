"""The plugin's loss in a Ray worker whose Python environment does not hold the plugin, as NeMo-RL's Megatron and
DTensor workers run: each in its own environment (NeMo-RL's ``PY_EXECUTABLES`` in
``nemo_rl/distributed/virtual_cluster.py``, passed to Ray as ``runtime_env={"py_executable": ...}``).

The worker's interpreter is a fresh venv (``python -m venv --without-pip``) whose only site entry is a ``.pth`` line
naming the test environment's site-packages (torch, pydantic, ray), which does not make the plugin importable: the
plugin is an editable install there, and a ``.pth`` file inside a directory that a ``.pth`` line adds is never run.
The driver, a separate process started outside the repository and without ``PYTHONPATH`` (Ray adds the driver's
working directory to its workers' ``sys.path``), builds the loss and sends it to two actors of that interpreter:

- set up as docs/nemo_rl.md documents (the plugin's source directory on ``PYTHONPATH``, which NeMo-RL forwards from the
  driver's environment to every worker): the worker unpickles the loss and computes the driver's value;
- not set up: the call fails with the documented error, ``No module named 'nemo_is_plugin'``.

Embedded local Ray (one CPU, no dashboard); one driver process for both actors, bounded by a timeout. verl's workers
get the loss from verl's own registry instead (its ``verl.plugins`` entry points load at ``import verl``): the check
docs/verl.md gives runs on the same interpreter, in a plain subprocess.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from helpers.worker_result import result_json

ray = pytest.importorskip("ray", reason="Ray is the demo extra: pip install 'nemo-is-plugin[demo]'")
import pydantic  # noqa: E402
import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DRIVER = textwrap.dedent("""
    import json, sys
    repo, worker_python = sys.argv[1], sys.argv[2]
    sys.path.insert(0, repo)  # the driver's own import of the plugin; nothing here reaches the workers
    import ray
    import torch
    from nemo_is_plugin.adapters.nemo_rl import NeMoRLLossFn

    loss_fn = NeMoRLLossFn({"use_importance_sampling_correction": True, "is_correction_level": "sequence_mean",
                            "reference_policy_kl_penalty": 0.0})
    g = torch.Generator().manual_seed(0)
    data = {"token_mask": torch.ones(2, 6), "sample_mask": torch.ones(2), "advantages": torch.randn(2, 6, generator=g),
            "prev_logprobs": -torch.rand(2, 6, generator=g), "generation_logprobs": -torch.rand(2, 6, generator=g)}
    x = -torch.rand(2, 5, generator=g)
    counts = dict(global_valid_seqs=torch.tensor(2.0), global_valid_toks=torch.tensor(10.0))

    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)

    @ray.remote(num_cpus=0)
    class PolicyWorker:
        def python(self):
            return sys.executable

        def train(self, loss_fn, x, data, counts):
            return float(loss_fn(next_token_logprobs=x, data=data, **counts)[0])

    out = {"driver_loss": float(loss_fn(next_token_logprobs=x, data=data, **counts)[0])}
    for name, runtime_env in (
        ("documented", {"py_executable": worker_python, "env_vars": {"PYTHONPATH": repo}}),
        ("not_set_up", {"py_executable": worker_python}),
    ):
        worker = PolicyWorker.options(runtime_env=runtime_env).remote()
        result = {"python": ray.get(worker.python.remote())}
        try:
            result["loss"] = ray.get(worker.train.remote(loss_fn, x, data, counts))
        except Exception as exc:
            result["error"] = f"{type(exc).__name__}: {exc}"
        out[name] = result
    ray.shutdown()
    print("RESULT " + json.dumps(out))
""")


def _site_packages_of(*modules) -> list[str]:
    return sorted({str(Path(m.__file__).resolve().parents[1]) for m in modules})


@pytest.fixture(scope="module")
def worker_python(tmp_path_factory) -> Path:
    """A venv without the plugin: its site holds one .pth naming the site-packages of torch, pydantic and ray."""
    venv = tmp_path_factory.mktemp("worker_env") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    site = subprocess.run(
        [str(python), "-c", "import site; print(site.getsitepackages()[0])"],
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout.strip()
    (Path(site) / "host_packages.pth").write_text("\n".join(_site_packages_of(torch, pydantic, ray)) + "\n")
    return python


def test_the_worker_environment_lacks_the_plugin(worker_python, tmp_path):
    probe = "import importlib.util as u; print(u.find_spec('nemo_is_plugin') is None, u.find_spec('torch') is not None)"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run(
        [str(worker_python), "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60
    )
    assert out.stdout.split() == ["True", "True"], out.stderr


@pytest.mark.timeout(420)
def test_pickled_loss_runs_in_a_worker_env_set_up_as_documented_and_fails_clearly_otherwise(worker_python, tmp_path):
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(OMP_NUM_THREADS="1", RAY_DISABLE_IMPORT_WARNING="1")
    proc = subprocess.run(
        [sys.executable, str(script), str(ROOT), str(worker_python)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=360,
    )
    out = result_json(proc)
    for name in ("documented", "not_set_up"):
        assert out[name]["python"] == str(worker_python), out[name]  # the actor ran on the plugin-less interpreter
    assert "error" not in out["documented"], out["documented"]
    assert out["documented"]["loss"] == pytest.approx(out["driver_loss"], rel=1e-6, abs=1e-9)
    assert out["driver_loss"] != 0.0
    assert "loss" not in out["not_set_up"]
    assert "No module named 'nemo_is_plugin'" in out["not_set_up"]["error"], out["not_set_up"]


VERL_CHECK = (
    "import verl\n"
    "from verl.trainer.ppo.core_algos import get_policy_loss_fn\n"
    "try:\n"
    "    print('FOUND', type(get_policy_loss_fn('nemo_is.clipped_pg')).__name__)\n"
    "except ValueError as exc:\n"
    "    print('ERROR', exc)\n"
)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("set_up", [True, False], ids=["source_dir_on_pythonpath", "not_set_up"])
def test_verl_worker_env_check_of_docs_verl(worker_python, tmp_path, set_up):
    """docs/verl.md's check on a verl worker's interpreter without the plugin: verl's entry-point discovery at
    `import verl` registers the loss when the plugin's source directory is on PYTHONPATH, and without it verl's
    lookup fails with its own `Unsupported loss mode` (the failing entry point is logged at debug level only)."""
    pytest.importorskip("verl.trainer.ppo.core_algos", reason="verl is the verl extra")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VERL_USE_EXTERNAL_PLUGINS")}
    env["OMP_NUM_THREADS"] = "1"
    if set_up:
        env["PYTHONPATH"] = str(ROOT)
    out = subprocess.run(
        [str(worker_python), "-c", VERL_CHECK], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240
    )
    assert out.returncode == 0, out.stderr[-3000:]
    last = out.stdout.strip().splitlines()[-1]
    if set_up:
        assert last == "FOUND VerlPolicyLoss", out.stdout[-2000:]
    else:
        assert last.startswith("ERROR Unsupported loss mode: nemo_is.clipped_pg. Supported modes are:"), last
