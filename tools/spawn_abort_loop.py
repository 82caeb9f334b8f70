"""Run one spawned test module's multi-process checks N times and count the runs where a rank aborted.

The proof behind tests/helpers/gloo.py (why every worker imports ``torch.distributed.nn.functional`` before
``init_process_group``), too long for the test suite (~8 s a run on 2 cores)::

    NEMO_RL_PATH=<NeMo-RL checkout> python -m tools.spawn_abort_loop 20              # the suite's harness
    NEMO_RL_PATH=<NeMo-RL checkout> python -m tools.spawn_abort_loop 20 --unguarded  # init first, import after

Default module: ``distributed.test_host_heads_real_nemo_rl`` (its checks import NeMo-RL's ``model_utils``, which
imports ``torch.distributed.nn.functional``, inside the workers). Measured on 2 CPU cores, torch 2.13, NeMo-RL
7ea279ab: the suite's harness before the guard, 3 of 20 runs aborted ("terminate called without an active
exception"); with it (the default here), 0 of 20; ``--unguarded`` (this file's copy of the harness in the old order):
3 of 12 aborted.
"""

from __future__ import annotations

import argparse
import collections
import importlib
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TESTS = str(Path(__file__).resolve().parents[1] / "tests")


def _unguarded_entry(rank: int, world_size: int, port: int, module_name: str) -> None:
    """The harness's order before the fix: the process group first, the checks' imports after (this module imports
    nothing that imports ``torch.distributed.nn.functional``)."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size, timeout=timedelta(seconds=120)
    )
    try:
        module = importlib.import_module(module_name)
        setup = getattr(module, "setup_workers", None)
        if setup is not None:
            setup(rank, world_size)
        for _name, fn in module.CHECKS:  # as tests/distributed/_spawn.py did before the guard, less the reporting
            fn(rank, world_size)
            gathered: list = [None] * world_size
            dist.all_gather_object(gathered, None)
    finally:
        dist.destroy_process_group()


def _one_run(module_name: str, world_size: int, guarded: bool) -> str:
    from distributed import _spawn  # type: ignore[import-not-found]  # tests/ on sys.path (main puts it there)

    if guarded:
        results = _spawn.run_checks(module_name, world_size)
        return "ok" if all(v is None for v in results.values()) else "check failed"
    mp.spawn(_unguarded_entry, args=(world_size, _spawn.free_port(), module_name), nprocs=world_size, join=True)
    return "ok"


def main(argv: list[str] | None = None) -> dict[str, int]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("runs", type=int)
    parser.add_argument("--module", default="distributed.test_host_heads_real_nemo_rl")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--unguarded", action="store_true", help="init_process_group before the checks' imports")
    args = parser.parse_args(argv)
    if TESTS not in sys.path:
        sys.path.insert(0, TESTS)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    counts: collections.Counter[str] = collections.Counter()
    for _ in range(args.runs):
        try:
            counts[_one_run(args.module, args.world_size, not args.unguarded)] += 1
        except mp.ProcessExitedException as exc:  # a rank killed by a signal: the abort this tool counts
            counts[f"aborted ({exc.exit_code if exc.signal_name is None else exc.signal_name})"] += 1
    print(f"{'unguarded' if args.unguarded else 'guarded'}: {dict(counts)} in {args.runs} runs of {args.module}")
    return dict(counts)


if __name__ == "__main__":
    main()
