"""scripts/gpu_check.sh: valid bash, only flags ``nemo-is bench`` really has, and its control flow (run on CPU with a
stand-in interpreter): every step runs even after one fails, the exit status is 1 and names the failed steps, each
step logs into $OUT, the head benchmark runs one process per model shape and renders one table from their results, a
Triton fallback in those results fails its check loudly, the model step runs with the strict-backend switch, the
host-heads benchmark gets NEMO_RL_PATH / VERL_PATH as its checkout flags and its check fails on a host not measured or
a plugin head off Triton (a host's own failing head is only reported), and a step stopped by its time limit fails."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import typer

from nemo_is_plugin.apps.bench.shapes import MODEL_SHAPES
from nemo_is_plugin.apps.cli.bench import register

REPO = Path(__file__).resolve().parents[3]
SCRIPT = REPO / "scripts" / "gpu_check.sh"


def _bench_flags() -> set[str]:
    app = typer.Typer()

    @app.callback()
    def _root() -> None:  # keep "bench" a subcommand
        pass

    register(app)
    group = typer.main.get_command(app)
    command = group.commands["bench"]  # type: ignore[attr-defined]
    return {opt for param in command.params for opt in param.opts}


def test_script_is_valid_bash_and_uses_only_real_bench_flags():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    text = SCRIPT.read_text().replace("\\\n", " ")  # join continued lines
    marker = "nemo_is_plugin.apps.cli.main bench"
    calls = [line.split(marker, 1)[1] for line in text.splitlines() if marker in line]
    assert len(calls) == 4  # one model per process, the merged report, the model step, the host heads
    used = {flag for call in calls for flag in re.findall(r"(--[a-z][a-z-]*)", call)}
    used |= set(re.findall(r"parts\+=\((--[a-z][a-z-]*)", text))  # the report's flags, gathered per model
    used |= set(re.findall(r"host_head_args\+=\((--[a-z][a-z-]*)", text))  # the host heads' checkout flags
    assert used == {
        "--device",
        "--model",
        "--out",
        "--from-json",
        "--model-step",
        "--host-heads",
        "--nemo-rl-path",
        "--verl-path",
    }
    assert used <= _bench_flags()


STAND_IN = r"""#!/usr/bin/env bash
# stands in for python: real python for the result checks (stdin scripts), canned outcomes for the rest
echo "$* | strict=${NEMO_IS_STRICT_BACKEND:-unset}" >> "$CALLS"
case "$1 $2" in
  "- "*) exec "$REAL_PYTHON" "$@" ;;
  "-c from nemo_is_plugin.apps.bench.shapes"*) exec "$REAL_PYTHON" "$@" ;;
  "-m pytest") exit 1 ;;
  "-m nemo_is_plugin.apps.bench.kernel_sweep") sleep 30 ;;
  "-m nemo_is_plugin.apps.cli.main")
    out=$(echo "$*" | sed -E 's/.*--out ([^ ]+).*/\1/'); mkdir -p "$out"
    if [[ "$*" == *--model-step* ]]; then echo '{"skipped": {}}' > "$out/model_step.json"
    elif [[ "$*" == *--host-heads* ]]; then cp "$HOST_HEADS_RESULTS" "$out/host_heads.json"
    else cp "$HEAD_RESULTS" "$out/results.json"; fi ;;
esac
exit 0
"""


def test_every_step_runs_failures_are_listed_and_a_triton_fallback_fails_loudly(tmp_path):
    root = tmp_path / "repo"
    (root / "scripts").mkdir(parents=True)
    (root / ".whl").mkdir()
    (root / ".whl" / "a-1-cp312-none-any.whl").write_text("")
    shutil.copy(SCRIPT, root / "scripts" / "gpu_check.sh")
    stand_in = tmp_path / "python"
    stand_in.write_text(STAND_IN)
    stand_in.chmod(0o755)
    head = dict(
        rows=[
            dict(model="m", path="naive", backend=None, failed={}),
            dict(model="m", path="fused_linear", backend="torch", failed={}),
        ],
        triton_fallback="_partials_kernel failed to compile: PTXASError: ptxas fatal",
    )
    (tmp_path / "head.json").write_text(json.dumps(head))
    host_heads = dict(
        rows=[
            dict(model="m", head="plugin_verl", backend="triton", failed={}),
            dict(model="m", head="plugin_nemo_rl", backend="torch", failed={}),
            dict(model="m", head="verl", backend=None, failed={"time": "AssertionError: hidden_size % 128"}),
        ],
        skipped={"nemo_rl": "nemo_rl.distributed.model_utils does not import"},
        triton_fallback=None,
    )
    (tmp_path / "host_heads.json").write_text(json.dumps(host_heads))
    out = tmp_path / "out"
    env = dict(
        os.environ,
        OUT=str(out),
        PYTHON=str(stand_in),
        REAL_PYTHON=sys.executable,
        CALLS=str(tmp_path / "calls"),
        HEAD_RESULTS=str(tmp_path / "head.json"),
        HOST_HEADS_RESULTS=str(tmp_path / "host_heads.json"),
        NEMO_RL_PATH="/ckpt/NeMo-RL",
        PYTHONPATH=str(REPO),
        TIMEOUT_SWEEP="1",
    )
    done = subprocess.run(
        ["bash", str(root / "scripts" / "gpu_check.sh")], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert "gpu_check FAILED: bench_head_results bench_host_heads_results pytest_gpu sweep (logs in" in done.stdout
    assert "=== sweep FAILED (exit 124" in (out / "sweep.log").read_text()  # stopped by TIMEOUT_SWEEP
    calls = (tmp_path / "calls").read_text().splitlines()
    assert any(".whl/a-1-cp312-none-any.whl" in c and "--no-index --no-deps" in c for c in calls)
    assert any(c.startswith("-m pytest -q -m gpu tests |") for c in calls)
    models = [s.name for s in MODEL_SHAPES]
    for model in models:
        assert any(f"bench --device cuda --model {model} --out {out}/head/{model} | strict=unset" in c for c in calls)
    parts = " ".join(f"--from-json {out}/head/{m}/results.json" for m in models)
    assert any(f"bench {parts} --out {out}/head | strict=unset" in c for c in calls)
    # the docs are written by the project's tooling from the saved results, not by the package's CLI
    assert any(c.startswith(f"-m tools.bench_docs head {out}/head/results.json |") for c in calls)
    assert any(c.startswith(f"-m tools.bench_docs host-heads {out}/host_heads/host_heads.json |") for c in calls)
    assert any(f"bench --model-step --device cuda --out {out}/step | strict=1" in c for c in calls)
    host = f"bench --host-heads --device cuda --nemo-rl-path /ckpt/NeMo-RL --out {out}/host_heads |"
    assert any(host in c for c in calls)
    host_check = (out / "bench_host_heads_results.log").read_text()
    assert "nemo_rl not measured: nemo_rl.distributed.model_utils does not import" in host_check
    assert "m plugin_nemo_rl ran on backend 'torch', not triton" in host_check
    assert "(host) m verl time: AssertionError" in host_check and "plugin_verl ran" not in host_check
    logs = ["install", "cuda", "pytest_gpu", "bench_head", "bench_head_results", "bench_step", "sweep"]
    logs += ["bench_host_heads", "bench_host_heads_docs", "bench_host_heads_results"]
    for name in logs + [f"bench_head_{m}" for m in models]:
        assert (out / f"{name}.log").exists(), name
    check = (out / "bench_head_results.log").read_text()
    assert "THE TRITON BACKEND FELL BACK TO TORCH: _partials_kernel failed to compile" in check
    assert "m fused_linear ran on backend 'torch', not triton" in check
    assert "bench_step_results FAILED" not in done.stdout
