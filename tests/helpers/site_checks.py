"""A check script run in a fresh interpreter with an extra site directory on its path (a package installed there, or
a distribution's metadata written by hand), so that what the entry points bring in is what that directory holds. The
script prints one JSON object as its last stdout line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def run_with_site(script: str, site: Path, *args: str, **env: str) -> Any:
    """The JSON of ``script``'s last stdout line, run as ``python -c script *args`` with ``site`` and the repository
    first on ``PYTHONPATH`` (``env`` added to the environment); fails with its stderr when it exits non-zero."""
    path = os.pathsep.join([str(site), str(ROOT), os.environ.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, "-c", script, *args],
        capture_output=True, text=True, timeout=300, check=False,
        env={**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", **env},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])
