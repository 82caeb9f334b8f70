"""A subprocess worker's answer: the last stdout line starting ``RESULT `` of a run that exited 0 (the functional
tests' worker scripts print it; anything else on stdout / stderr is the run's log, shown when the run failed)."""

from __future__ import annotations

import json
import subprocess
from typing import Any

PREFIX = "RESULT "


def result_text(proc: subprocess.CompletedProcess) -> str:
    """The text after ``RESULT `` on the last such line; fails with the run's output tails otherwise."""
    lines = [line for line in proc.stdout.splitlines() if line.startswith(PREFIX)]
    assert proc.returncode == 0 and lines, proc.stdout[-2000:] + proc.stderr[-3000:]
    return lines[-1].removeprefix(PREFIX)


def result_json(proc: subprocess.CompletedProcess) -> Any:
    """:func:`result_text`, read as JSON."""
    return json.loads(result_text(proc))
