"""Run ``nemo-is`` in a child process (the model step initialises torch.distributed and megatron's global state,
which must not leak into the test process) with this checkout first on the path."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def run_cli(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
        COLUMNS="200",
    )
    return subprocess.run(
        [sys.executable, "-m", "nemo_is_plugin.apps.cli.main", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        cwd=REPO,
    )
