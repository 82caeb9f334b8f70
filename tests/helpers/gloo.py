"""The one way the suite's worker processes join a gloo process group: :func:`init_gloo`.

Why it exists: a process that imports ``torch.distributed.nn.functional`` *after* ``init_process_group`` and then runs
gloo collectives can abort at exit ("terminate called without an active exception", SIGABRT, after every rank has
finished its work). The import initialises torch's RPC bindings (``torch/distributed/nn/__init__.py`` imports
``RemoteModule``, whose ``torch.distributed.rpc`` calls ``torch._C._rpc_init()``). NeMo-RL's
``nemo_rl/distributed/model_utils.py`` makes that import, so a test that loads NeMo-RL inside a worker hit it in about
3 runs in 20 (tests/distributed/test_host_heads_real_nemo_rl.py, torch 2.13); imported before ``init_process_group``,
0 in 20 (tools/spawn_abort_loop.py repeats it).

This module imports ``torch.distributed.nn.functional`` when it is imported, so a worker is immune once the module
holding its entry function imports this one (a spawned child imports that module before it runs the function) or
once it calls :func:`init_gloo`. tests/test_spawn_harness.py holds every file of the suite that starts processes or
process groups to that rule.
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist
import torch.distributed.nn.functional  # noqa: F401  # before any init_process_group in this process: see above

GROUP_TIMEOUT = timedelta(seconds=120)


def init_gloo(rank: int, world_size: int, init_method: str, timeout: timedelta = GROUP_TIMEOUT) -> None:
    """``init_process_group("gloo", ...)`` in a worker that is immune to the abort above.

    The timeout turns a rank stuck in a collective into an error instead of a stuck CI job."""
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size, timeout=timeout)
