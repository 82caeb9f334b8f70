"""The kernel sweep (``python -m nemo_is_plugin.apps.bench.kernel_sweep``) runs every launch of its grids through
Triton's interpreter on CPU (tiny chunk): one row per (kernel, launch) with positive seconds and the bandwidth those
seconds give for the bytes each kernel must move, the torch baseline beside them, the default launch parameters restored
afterwards, and the JSON written. Speed itself is read on a GPU (scripts/gpu_check.sh), not asserted here."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from nemo_is_plugin.apps.bench.kernel_sweep import GRAD_GRID, PARTIALS_GRID

from ._cli import REPO

CHILD = """
import json, sys, torch
from nemo_is_plugin.apps.bench import kernel_sweep
from nemo_is_plugin.kernels import triton_logprob as tk
before = tk.BLOCKS
kernel_sweep.main(["--out", sys.argv[1], "--device", "cpu", "--rows", "3", "--vocab", "200", "--reps", "1",
                   "--models"])
assert tk.BLOCKS is before, "the sweep left its launch parameters in place"
"""


def test_sweep_measures_every_launch_and_restores_the_defaults(tmp_path):
    out = tmp_path / "sweep.json"
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(out)], env=env, capture_output=True, text=True, timeout=600, cwd=REPO
    )
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(out.read_text())
    assert "chunks" not in result  # no models given: the fused-path sweep is skipped
    rows = result["kernels"]
    launches = {(r["kernel"], r["block"], r["warps"]) for r in rows}
    assert launches == (
        {(k, b, w) for k in ("partials", "partials_entropy") for b, w in PARTIALS_GRID}
        | {("logits_grad", b, w) for b, w in GRAD_GRID}
        | {("torch_logsumexp_fp32", None, None)}
    )
    chunk_bytes = 3 * 200 * 2  # bf16
    for r in rows:
        assert "failed" not in r, r
        assert (r["rows"], r["vocab"], r["dtype"]) == (3, 200, "bfloat16")
        moved = 2 * chunk_bytes if r["kernel"] == "logits_grad" else chunk_bytes
        assert r["seconds"] > 0 and abs(r["gbps"] * r["seconds"] * 1e9 - moved) < 1e-6 * moved
