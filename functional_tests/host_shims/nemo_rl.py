"""NeMo-RL's DTensor v1 policy worker on CPU gloo processes: where its source is, and what its GPU-only calls need.

Written against NVIDIA-NeMo/RL @7ea279abfbeb698b092856d0dab61e7cf39bc909. Each shim names the NeMo-RL file and line
it works around. None of them changes what the worker computes: device strings, the process-group backend, a GPU
index read for NUMA pinning, NVTX ranges, and imports of code the training step never runs (loggers, vLLM's
HTTP server).

- ``nemo_rl_path()``: the folder holding ``nemo_rl/``, from ``NEMO_RL_PATH`` or the pinned snapshot beside the
  project (``../shared/hosts/nemo_rl-7ea279ab``); None when neither exists (the tests then skip naming the variable).
- ``install()``: call once in a fresh process before importing NeMo-RL's worker module.
- ``cpu_device()``: a context in which NeMo-RL's ``"cuda"`` tensors are made on the CPU (enter it around the
  worker's ``__init__`` and ``train``).
"""

from __future__ import annotations

import importlib.machinery
import os
import sys
import types
from pathlib import Path
from typing import Any

import torch
from helpers import gloo  # noqa: F401  (torch.distributed.nn.functional before init_process_group: helpers/gloo.py)

from host_shims.cuda_to_cpu import CudaToCpu

PATH_VARIABLE = "NEMO_RL_PATH"
PINNED_FOLDER = "nemo_rl-7ea279ab"


def nemo_rl_path() -> str | None:
    """``$NEMO_RL_PATH`` if set, else the pinned snapshot in the shared folder beside the project, if present."""
    given = os.environ.get(PATH_VARIABLE)
    if given:
        return given if (Path(given) / "nemo_rl").is_dir() else None
    project = Path(__file__).resolve().parents[2]
    pinned = project.parent / "shared" / "hosts" / PINNED_FOLDER
    return str(pinned) if (pinned / "nemo_rl").is_dir() else None


SKIP_REASON = (
    f"NeMo-RL's source is not here: set {PATH_VARIABLE} to a checkout of NVIDIA-NeMo/RL @7ea279ab (the folder holding "
    f"nemo_rl/), or place the pinned snapshot at ../shared/hosts/{PINNED_FOLDER}"
)


def _empty_module(name: str, **attrs: Any) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)  # found, with no package metadata: "not installed"
    for key, value in attrs.items():
        setattr(module, key, value)
    return module


class _Unused:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError("a shimmed import of NeMo-RL (host_shims/nemo_rl.py) was used in the training-step test")


def stub_unused_imports() -> None:
    """Module-level imports of code the training step never runs; they (and their dependency trees) are not installed
    in CI, so each is an empty module (found, without package metadata: "not installed" to transformers' and
    accelerate's checks), and constructing what the host imports from one fails loudly.

    - nemo_rl/utils/logger.py:27-41: mlflow, swanlab, wandb, torch.utils.tensorboard (the experiment loggers; reached
      from the worker through nemo_rl/algorithms/loss/loss_functions.py:26 -> nemo_rl/algorithms/utils.py:32);
    - nemo_rl/models/generation/vllm/vllm_worker_async.py:27-28: uvicorn, fastapi (vLLM's HTTP server; reached through
      nemo_rl/models/policy/__init__.py:17 -> nemo_rl/models/generation/__init__.py).
    """
    for name in ("mlflow", "swanlab", "wandb", "uvicorn"):
        sys.modules.setdefault(name, _empty_module(name))
    sys.modules.setdefault("fastapi", _empty_module("fastapi", FastAPI=_Unused))
    sys.modules.setdefault("torch.utils.tensorboard", _empty_module("torch.utils.tensorboard", SummaryWriter=_Unused))


def cpu_device() -> CudaToCpu:
    """dtensor_policy_worker.py:618, 675, 704, 739, 759, 999 (``torch.tensor(..., device="cuda")``, ``.cuda()``),
    :652 (``data.to("cuda")``) and nemo_rl/models/dtensor/parallelize.py:855, 867 (the grad norm's ``device="cuda"``)
    place tensors on a GPU by name; here they stay on the CPU."""
    return CudaToCpu()


def install() -> None:
    """The process-wide shims, in a process that runs NeMo-RL's worker and nothing else."""
    import ray
    import torch.distributed as dist
    import torch.distributed.device_mesh as device_mesh

    stub_unused_imports()

    # dtensor_policy_worker.py:230: bind_to_gpu_numa(int(ray.get_gpu_ids()[0])) outside a Ray actor; NeMo-RL's own
    # switch (nemo_rl/distributed/numa_utils.py:58) turns the pinning off, the GPU index is read first.
    os.environ["NRL_DISABLE_NUMA_BINDING"] = "1"
    ray.get_gpu_ids = lambda: [0]

    # dtensor_policy_worker.py:262: init_process_group(backend="nccl") -> gloo (rank, world size and address from the
    # environment, as NeMo-RL's worker group sets them). A second worker in the same process (the tests build one per
    # loss, each from the same weights) keeps the process group of the first.
    init_process_group = dist.init_process_group

    def gloo_init_process_group(*args: Any, **kwargs: Any) -> None:
        if dist.is_initialized():
            return
        kwargs["backend"] = "gloo"
        init_process_group(*args, **kwargs)

    dist.init_process_group = gloo_init_process_group

    # dtensor_policy_worker.py:408: init_device_mesh("cuda", (dp, cp, tp)) -> a CPU mesh.
    init_device_mesh = device_mesh.init_device_mesh

    def cpu_device_mesh(device_type: str, *args: Any, **kwargs: Any) -> Any:
        return init_device_mesh("cpu" if device_type == "cuda" else device_type, *args, **kwargs)

    device_mesh.init_device_mesh = cpu_device_mesh

    # nemo_rl/utils/nsys.py:118, 121 (wrap_with_nvtx_name, around train): NVTX ranges, absent from a CPU build.
    torch.cuda.nvtx.range_push = lambda *args, **kwargs: None
    torch.cuda.nvtx.range_pop = lambda *args, **kwargs: None

    # dtensor_policy_worker.py:1010: the metrics name the GPU (torch.cuda.get_device_name() raises without one).
    torch.cuda.get_device_name = lambda *args, **kwargs: "cpu"
