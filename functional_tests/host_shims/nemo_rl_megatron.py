"""NeMo-RL's Megatron policy worker's ``train`` on CPU gloo processes: its Megatron-Bridge imports and GPU-only calls.

Written against NVIDIA-NeMo/RL @7ea279abfbeb698b092856d0dab61e7cf39bc909 (its Megatron-Bridge submodule at 8c46dc42)
and megatron-core 0.19.2 (the stacks tier's lock). Each shim names the file and line it works around. None of them
changes what the step computes.

- Megatron-Bridge (``megatron.bridge``): NeMo-RL imports it at module level in
  nemo_rl/models/policy/workers/megatron_policy_worker.py:29-38, nemo_rl/models/megatron/config.py:19-21 (type
  annotations), nemo_rl/models/megatron/data.py:20-22 and nemo_rl/models/megatron/setup.py (the worker's ``__init__``,
  which the test does not run). Megatron-Bridge's package ``__init__`` files import its model zoo, and its wheels
  need Python 3.12 (docs/testing.md). Here:

  - ``megatron/bridge/training/utils/packed_seq_utils.py`` (``get_packed_seq_cp_partition_indices``, which NeMo-RL's
    CP sharding of packed sequences calls) is executed as written from the file at 8c46dc42, found through
    ``MEGATRON_BRIDGE_PATH`` or the snapshot ``megatron_bridge-8c46dc42`` beside NeMo-RL's source; its parent packages
    are empty placeholders, so no Megatron-Bridge ``__init__`` runs;
  - every other name imported from ``megatron.bridge`` is a placeholder: a class (usable as an annotation, a base or
    an ``isinstance`` target, refusing to be instantiated) for a capitalised name, else a function that raises when
    called;
  - except the three functions ``MegatronPolicyWorkerImpl.train`` calls (megatron_policy_worker.py:961-987):
    ``get_pg_collection`` (Megatron-Bridge training/utils/pg_utils.py: the model's ``pg_collection`` attribute) and
    ``logical_and_across_model_parallel_group`` / ``reduce_max_stat_across_model_parallel_group`` (training/utils/
    train_utils.py: a MIN all-reduce of a bool, a MAX all-reduce of a float32 stat with None as -1, over the given
    model-parallel group), written here from their documented behaviour.

- tensordict and datasets, imported at module level by code ``train`` does not run: placeholders too
  (``PLACEHOLDER_ROOTS``); megatron-core 0.19.2's missing names and CUDA calls: :func:`install`.

``install(nemo_rl_root)``: once per fresh process, before NeMo-RL's modules are imported.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

BRIDGE_PATH_VARIABLE = "MEGATRON_BRIDGE_PATH"
BRIDGE_PINNED_FOLDER = "megatron_bridge-8c46dc42"
BRIDGE = "megatron.bridge"
PACKED_SEQ_UTILS = "megatron.bridge.training.utils.packed_seq_utils"


def megatron_bridge_path(nemo_rl_root: str | None) -> str | None:
    """``$MEGATRON_BRIDGE_PATH`` if set, else the pinned snapshot beside NeMo-RL's folder (``nemo_rl_root``, see
    host_shims/nemo_rl.py); the folder holding ``src/megatron/bridge``. None when it holds no packed_seq_utils.py."""
    given = os.environ.get(BRIDGE_PATH_VARIABLE)
    if given:
        root = Path(given)
    elif nemo_rl_root is not None:
        root = Path(nemo_rl_root).parent / BRIDGE_PINNED_FOLDER
    else:
        return None
    return str(root) if _packed_seq_utils_file(str(root)).is_file() else None


def _packed_seq_utils_file(root: str) -> Path:
    return Path(root, "src", *PACKED_SEQ_UTILS.split(".")).with_suffix(".py")


class _Placeholder:
    """A Megatron-Bridge class the step only names (annotations, ``isinstance``): it cannot be built."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError(
            f"{type(self).__module__}.{type(self).__name__} is a placeholder (host_shims/nemo_rl_megatron.py); "
            "the Megatron step test must not build it"
        )


def _placeholder_attribute(module: str):
    def attribute(name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        if name[:1].isupper():
            return type(name, (_Placeholder,), {"__module__": module})

        def refuse(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError(
                f"{module}.{name} is stubbed (host_shims/nemo_rl_megatron.py); the step must not call it"
            )

        refuse.__name__ = name
        return refuse

    return attribute


def get_pg_collection(model: Any) -> Any:
    """The model's process-group collection (a list of chunks: the first one's)."""
    return (model[0] if isinstance(model, list) else model).pg_collection


def logical_and_across_model_parallel_group(value: bool, mp_group: Any) -> bool:
    """True where every rank of ``mp_group`` holds True."""
    flag = torch.tensor([1 if value is True else 0], dtype=torch.int)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=mp_group)
    return bool(flag.item())


def reduce_max_stat_across_model_parallel_group(stat: float | None, mp_group: Any) -> float | None:
    """The max of ``stat`` over ``mp_group`` as a float32 (a rank without one sends -1; all -1 gives None)."""
    value = torch.tensor([-1.0 if stat is None else stat], dtype=torch.float32)
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=mp_group)
    return None if value.item() == -1.0 else value.item()


# The Megatron-Bridge functions the step calls, by module (the names megatron_policy_worker.py:33-37 imports).
CALLED = {
    "megatron.bridge.training.utils.pg_utils": {"get_pg_collection": get_pg_collection},
    "megatron.bridge.training.utils.train_utils": {
        "logical_and_across_model_parallel_group": logical_and_across_model_parallel_group,
        "reduce_max_stat_across_model_parallel_group": reduce_max_stat_across_model_parallel_group,
    },
}


# Packages whose every module is a placeholder package (the names above): Megatron-Bridge, and tensordict, imported at
# module level by NeMo-RL's transfer-queue data plane (nemo_rl/data_plane/codec.py:42, interfaces.py:42, reached from
# megatron_policy_worker.py:58, ``TQWorkerMixin``), which ``train`` does not use.
# datasets (nemo_rl/data/llm_message_utils.py:19, ``Dataset`` for data loading, reached through
# nemo_rl/data_plane/worker_mixin.py:36).
PLACEHOLDER_ROOTS = (BRIDGE, "tensordict", "datasets")


class _BridgeFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """``megatron.bridge.*``: packed_seq_utils from its file; it and tensordict's other modules placeholders."""

    def __init__(self, bridge_root: str) -> None:
        self.bridge_root = bridge_root

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name == PACKED_SEQ_UTILS:
            return importlib.util.spec_from_file_location(name, _packed_seq_utils_file(self.bridge_root))
        if any(name == root or name.startswith(root + ".") for root in PLACEHOLDER_ROOTS):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = _placeholder_attribute(spec.name)  # type: ignore[method-assign]  (PEP 562 hook)
        for key, value in CALLED.get(spec.name, {}).items():
            setattr(module, key, value)
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


def install_bridge(bridge_root: str) -> None:
    """The Megatron-Bridge finder first on ``sys.meta_path`` (idempotent)."""
    if not any(isinstance(f, _BridgeFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _BridgeFinder(bridge_root))


def install_missing_megatron_core_names() -> None:
    """megatron_policy_worker.py:42-45 imports ``FullyShardedDataParallelV1`` / ``V2`` from megatron-core's
    ``distributed/fsdp/mcore_fsdp_adapter.py``, names of the Megatron-LM NeMo-RL pins that megatron-core 0.19.2 does not
    have (it has ``FullyShardedDataParallel``); the worker uses them only in an ``isinstance`` outside ``train``
    (line 3219). Placeholder classes where absent."""
    import megatron.core.distributed.fsdp.mcore_fsdp_adapter as adapter

    for name in ("FullyShardedDataParallelV1", "FullyShardedDataParallelV2"):
        if not hasattr(adapter, name):
            setattr(adapter, name, type(name, (_Placeholder,), {"__module__": adapter.__name__}))


_CPU_MODE: list[Any] = []


class _NoStream:
    """The current stream of a device without streams: waiting on it is immediate."""

    def wait_event(self, event: Any) -> None:
        return None

    def wait_stream(self, stream: Any) -> None:
        return None


def cp_gather_backward_on_cpu() -> None:
    """nemo_rl/distributed/model_utils.py:1369-1371: ``AllGatherCPTensor.backward`` (the backward of the log-probs'
    gather over the CP group) builds its chunk index with ``pin_memory=True`` and ``.cuda()``. Autograd runs a
    backward without the process's torch-function mode (its mode stack is empty there), so this one runs inside a
    :class:`~host_shims.cuda_to_cpu.CudaToCpu` of its own (idempotent)."""
    from nemo_rl.distributed.model_utils import AllGatherCPTensor

    from host_shims.cuda_to_cpu import CudaToCpu

    backward = AllGatherCPTensor.backward
    if getattr(backward, "_nemo_is_cpu", False):
        return

    def backward_on_cpu(ctx: Any, *grads: Any) -> Any:
        with CudaToCpu():
            return backward(ctx, *grads)

    backward_on_cpu._nemo_is_cpu = True  # type: ignore[attr-defined]
    AllGatherCPTensor.backward = staticmethod(backward_on_cpu)  # type: ignore[method-assign,assignment]


def install(nemo_rl_root: str) -> None:
    """The process-wide shims, in a process that runs NeMo-RL's Megatron step and nothing else, before NeMo-RL's
    modules are imported.

    - host_shims/nemo_rl.py's (the DTensor step's): the unused imports stubbed, gloo, the GPU index, NVTX, the
      device name in the metrics (megatron_policy_worker.py:1067);
    - Megatron-Bridge and the megatron-core names above;
    - ``torch.cuda.synchronize`` around the timed part of ``train`` (megatron_policy_worker.py:815, :1001): nothing
      to wait for;
    - ``torch.cuda.current_stream()``, read by megatron-core 0.19.2's grad sync
      (distributed/param_and_grad_buffer.py:632) to wait on CUDA-graph events, which a CPU model never records: a
      stream with nothing to wait for;
    - the backward of NeMo-RL's gather over the CP group in a CPU mode of its own (``cp_gather_backward_on_cpu``);
    - megatron-core on a CPU (``nemo_is_plugin.apps.demo.model.apply_cpu_patches``: buffers on the current device, a
      CPU RNG tracker, no Transformer Engine GEMM in the router);
    - a process-wide :class:`~host_shims.cuda_to_cpu.CudaToCpu` mode with CUDA type names: NeMo-RL's ``"cuda"``
      tensors (megatron_policy_worker.py:787, data.py:126 ``data_dict.to("cuda")``, :816 ``.cuda()``,
      train.py:855) and megatron-core's (the grad buffers on ``torch.cuda.current_device()``, the optimizer's and
      grad clipping's ``device="cuda"``, clip_grads.py's ``'torch.cuda.FloatTensor'`` check) stay on the CPU.
    """
    from host_shims import nemo_rl as dtensor_shims
    from host_shims.cuda_to_cpu import CudaToCpu
    from nemo_is_plugin.apps.demo.model import apply_cpu_patches

    bridge = megatron_bridge_path(nemo_rl_root)
    if bridge is None:
        raise RuntimeError(SKIP_REASON)
    dtensor_shims.install()
    install_bridge(bridge)
    install_missing_megatron_core_names()
    torch.cuda.synchronize = lambda *args, **kwargs: None  # type: ignore[assignment]
    torch.cuda.current_stream = lambda *args, **kwargs: _NoStream()  # type: ignore[assignment]
    apply_cpu_patches()
    cp_gather_backward_on_cpu()
    if not _CPU_MODE:
        mode = CudaToCpu(cuda_type_names=True)
        mode.__enter__()
        _CPU_MODE.append(mode)


SKIP_REASON = (
    f"Megatron-Bridge's packed_seq_utils.py is not here: set {BRIDGE_PATH_VARIABLE} to a checkout of "
    f"NVIDIA-NeMo/Megatron-Bridge @8c46dc42 (the folder holding src/megatron/bridge), or place the snapshot folder "
    f"{BRIDGE_PINNED_FOLDER} beside NeMo-RL's source"
)
