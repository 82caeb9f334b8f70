"""Shared fixtures of the end-to-end tests."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def demo_quick_run(tmp_path_factory) -> Path:
    """One ``nemo-is demo --quick`` run (~1.5 min on 2 cores), shared by the demo and diagnose tests."""
    out = tmp_path_factory.mktemp("demo")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "nemo_is_plugin.apps.cli.main", "demo", "--quick", "--output-dir", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out
