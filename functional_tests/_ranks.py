"""What the host-step checks collect from their gloo ranks, written once for slime's (``_slime_step``), verl's
(``_verl_step``, test_verl_step_*.py) and NeMo-RL's (``_nemo_rl_step``) steps: one object from every rank, a parameter
whole on every rank, and values that rank 0 hands back to the test process.

The checks run under tests/distributed/_spawn.py's ``run_checks``, which reports only pass or fail per check; a test
that reads values after the spawn (NeMo-RL's step results, verl's M2PO span records) gets them through
:func:`publish` on rank 0 and :func:`published` in the test process, in the folder :func:`results_folder` names to the
ranks (the spawned processes inherit the environment).
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

RESULTS_DIR_ENV = "NEMO_IS_RANK_RESULTS_DIR"
JOB = "job"  # the file the test process writes a job to, in the results folder (run_job)


def gather_objects(obj: Any, group: Any = None) -> list[Any]:
    """``obj`` of every rank of ``group`` (None: the default group), in rank order, on every rank."""
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def whole(tensor: torch.Tensor, group: Any = None, dim: int = 0) -> torch.Tensor:
    """A parameter's full value on every rank: a DTensor's ``full_tensor()`` (FSDP2's and NeMo-RL's TP shards); with
    ``group``, this rank's tensor-parallel shard all-gathered over ``group`` and joined along ``dim`` (megatron-core's
    layers); otherwise the tensor itself."""
    if hasattr(tensor, "full_tensor"):
        return tensor.full_tensor()
    if group is None:
        return tensor
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


@contextmanager
def results_folder(folder: Path | str, **env: str) -> Iterator[Path]:
    """``folder`` named to the ranks spawned inside the block (with any further environment variables ``env``),
    removed from the environment after it."""
    names = {RESULTS_DIR_ENV: str(folder), **env}
    os.environ.update(names)
    try:
        yield Path(folder)
    finally:
        for name in names:
            del os.environ[name]


def publish(name: str, value: Any) -> None:
    """On rank 0, ``value`` (JSON) as ``name`` in the folder the test process named (:func:`results_folder`); nothing
    without one (a check that runs without a reader)."""
    folder = os.environ.get(RESULTS_DIR_ENV)
    if folder and dist.get_rank() == 0:
        Path(folder, f"{name}.json").write_text(json.dumps(value))


def published(folder: Path | str, name: str) -> Any:
    """What rank 0 published as ``name`` in ``folder``."""
    return json.loads(Path(folder, f"{name}.json").read_text())


def the_job() -> Any:
    """In a rank spawned by :func:`run_job`: the job the test process handed it."""
    return published(os.environ[RESULTS_DIR_ENV], JOB)


def run_job(module_name: str, world_size: int, job: Any) -> Any:
    """Spawn ``world_size`` ranks running ``module_name``'s checks (tests/distributed/_spawn.py's ``run_checks``) with
    ``job`` (JSON) readable through :func:`the_job`; every check must pass. Returns what rank 0 published as
    ``"results"``."""
    from distributed._spawn import run_checks

    with tempfile.TemporaryDirectory() as tmp, results_folder(tmp) as folder:
        (folder / f"{JOB}.json").write_text(json.dumps(job))
        errors = run_checks(module_name, world_size)
        failed = {name: error for name, error in errors.items() if error is not None}
        assert not failed, "\n".join(f"{name}: {error}" for name, error in failed.items())
        return published(folder, "results")
