"""Run a test module's Triton checks under Triton's interpreter (``TRITON_INTERPRET=1``: numpy on CPU).

Triton reads ``TRITON_INTERPRET`` when it is first imported, so the checks run in a fresh Python process. A module
defines ``INTERPRETER_CHECKS = {name: fn}`` (``fn()`` raises on failure); ``interpreter_results(module_name, dir)``
runs them all in one child process and returns ``{name: None | traceback}``, so each pytest test asserts its own
check and a failure is reported by name. The interpreter checks indexing, masking and math on tiny shapes, not GPU
compilation (tests/kernels/test_triton_compile.py) or speed.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import traceback
from pathlib import Path

TESTS_DIR = str(Path(__file__).resolve().parents[1])


def run_checks(module_name: str, out_path: str) -> None:
    """Child-process entry: every check of ``module_name``, its traceback or None, as JSON."""
    checks = importlib.import_module(module_name).INTERPRETER_CHECKS
    results = {}
    for name, fn in checks.items():
        try:
            fn()
            results[name] = None
        except Exception:
            results[name] = traceback.format_exc()
    Path(out_path).write_text(json.dumps(results))


def interpreter_results(module_name: str, tmp_dir: Path, timeout: int = 900) -> dict:
    out = Path(tmp_dir) / "results.json"
    code = (
        f"import sys; sys.path.insert(0, {TESTS_DIR!r}); from kernels._interpreter import run_checks; "
        f"run_checks({module_name!r}, {str(out)!r})"
    )
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    subprocess.run([sys.executable, "-W", "error::RuntimeWarning", "-c", code], env=env, check=True, timeout=timeout)
    return json.loads(out.read_text())
