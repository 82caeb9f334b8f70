"""Every worker process the suite starts is immune to the gloo exit abort (tests/helpers/gloo.py says why).

A spawned child imports the module that holds its entry function before it runs it; so a file that starts processes
or process groups must import ``helpers.gloo`` (which imports ``torch.distributed.nn.functional`` at once) or call
``init_gloo``. The repeated-run proof is a tool (tools/spawn_abort_loop.py), too slow for the suite.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STARTS_WORKERS = re.compile(
    r"init_process_group\(|mp\.spawn\(|\bspawn\(_|start_processes\(|get_context\(\s*[\"']spawn[\"']\s*\)"
)
GUARDED = re.compile(r"^\s*(from helpers\.gloo import|from helpers import gloo|import helpers\.gloo)", re.M)


def _worker_starting_files() -> list[Path]:
    files = [p for d in ("tests", "functional_tests") for p in sorted((ROOT / d).rglob("*.py"))]
    return [p for p in files if p.name != "gloo.py" and p != Path(__file__) and STARTS_WORKERS.search(p.read_text())]


def test_every_file_that_starts_workers_imports_the_guard():
    files = _worker_starting_files()
    names = {p.relative_to(ROOT).as_posix() for p in files}
    # the harnesses known today are found (so the pattern still matches what they write)
    assert {
        "tests/distributed/_spawn.py",
        "functional_tests/_nemo_rl_driver.py",
        "tests/helpers/demo_parity.py",
    } <= names
    unguarded = sorted(p.relative_to(ROOT).as_posix() for p in files if not GUARDED.search(p.read_text()))
    assert not unguarded, f"start workers without importing helpers.gloo (see tests/helpers/gloo.py): {unguarded}"


def test_the_guard_imports_the_module_before_any_process_group():
    """In a fresh interpreter: importing helpers.gloo loads torch.distributed.nn.functional with no process group
    yet, and init_gloo then joins a one-rank group."""
    code = (
        "import sys, tempfile, os\n"
        "import torch.distributed as dist\n"
        "assert 'torch.distributed.nn.functional' not in sys.modules\n"
        "from helpers.gloo import init_gloo\n"
        "assert 'torch.distributed.nn.functional' in sys.modules and not dist.is_initialized()\n"
        "d = tempfile.mkdtemp()\n"
        "init_gloo(0, 1, 'file://' + os.path.join(d, 'store'))\n"
        "t = __import__('torch').ones(3); dist.all_reduce(t); dist.destroy_process_group()\n"
        "print(float(t.sum()))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT / "tests", capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "3.0"
