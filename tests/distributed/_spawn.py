"""Run a module's list of multi-process checks once, in ``world_size`` gloo processes, and report per check.

A test module defines ``CHECKS = [(name, fn), ...]`` where ``fn(rank, world_size)`` runs on every rank (collectives
included) and raises on failure. ``run_checks`` spawns the processes once for the whole module; every rank runs every
check in order, the ranks' outcomes are gathered after each check, and the parent gets ``{name: None | traceback}``.
Pytest tests parametrised over the names then assert their own check passed, so a failure is reported by name.

To keep the ranks in step a check should finish all its collectives before it asserts; a process group timeout turns
an unexpected hang into an error instead of a stuck CI job.
"""

from __future__ import annotations

import importlib
import json
import os
import socket
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers.gloo import init_gloo  # imports torch.distributed.nn.functional before any process group (see there)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _log_time(rank: int, what: str, since: float) -> None:
    """With SPAWN_TIMING=1 (and pytest -s), rank 0 prints where the wall time goes."""
    if rank == 0 and os.environ.get("SPAWN_TIMING"):
        print(f"[spawn timing] {what}: {time.perf_counter() - since:.2f}s", flush=True)


def _entry(rank: int, world_size: int, port: int, module_name: str, out_path: str) -> None:
    start = time.perf_counter()
    torch.set_num_threads(1)
    init_gloo(rank, world_size, f"tcp://127.0.0.1:{port}")
    try:
        module = importlib.import_module(module_name)
        _log_time(rank, "import", start)
        setup = getattr(module, "setup_workers", None)
        if setup is not None:
            setup(rank, world_size)
        results: dict[str, str | None] = {}
        _log_time(rank, "setup", start)
        for name, fn in module.CHECKS:
            check_start = time.perf_counter()
            try:
                fn(rank, world_size)
                error = None
            except Exception:  # reported per check to the parent, with the failing rank
                error = f"rank {rank}:\n{traceback.format_exc()}"
            errors: list = [None] * world_size
            dist.all_gather_object(errors, error)
            failed = [e for e in errors if e is not None]
            results[name] = "\n".join(failed) if failed else None
            _log_time(rank, f"check {name}", check_start)
        if rank == 0:
            with open(out_path, "w") as f:
                json.dump(results, f)
    finally:
        dist.destroy_process_group()


def run_checks(module_name: str, world_size: int) -> dict[str, str | None]:
    """Spawn ``world_size`` processes running ``module_name.CHECKS``; return ``{name: None or error text}``."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "results.json")
        mp.spawn(_entry, args=(world_size, free_port(), module_name, out), nprocs=world_size, join=True)
        with open(out) as f:
            return json.load(f)
