"""slime's ``train_one_step`` on CPU gloo processes: where slime's source is, and what its GPU-only calls need.

Written against THUDM/slime @624b824a898ab0ec1fcb4d373004c7f3852bf515 and megatron-core 0.16.1 (the lock's). Each
shim names the file and line it works around. None changes what the step computes: an accelerator registered through
slime's own hook, megatron-core's hard-coded ``"cuda"`` devices kept on the CPU, and imports the step never calls.

- ``slime_path()``: the folder holding ``slime/``, from ``SLIME_PATH`` or the pinned snapshot ``slime-624b824a`` in
  the hosts folder beside the project; None when neither exists (the tests then skip, naming the variable).
- ``install(get_args)``: once per fresh process, before importing slime's ``model`` module: the stubbed imports,
  megatron-core's CUDA calls (generic megatron-core shims, written here for slime's step) and the CPU accelerator.
- ``cpu_device()``: a context in which megatron-core's ``"cuda"`` tensors are made on the CPU (enter it around the
  model, optimizer and step).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from host_shims.cuda_to_cpu import CudaToCpu

PATH_VARIABLE = "SLIME_PATH"
PINNED_FOLDER = "slime-624b824a"
SKIP_REASON = (
    f"slime's source is not here: set {PATH_VARIABLE} to a checkout of THUDM/slime @624b824a (the folder holding "
    f"slime/), or place the pinned snapshot folder {PINNED_FOLDER} in the hosts folder beside the project"
)


def slime_path() -> str | None:
    """``$SLIME_PATH`` if set, else the pinned snapshot in the shared folder beside the project, if present."""
    given = os.environ.get(PATH_VARIABLE)
    if given:
        return given if (Path(given) / "slime").is_dir() else None
    project = Path(__file__).resolve().parents[2]
    pinned = project.parent / "shared" / "hosts" / PINNED_FOLDER
    return str(pinned) if (pinned / "slime").is_dir() else None


# slime/backends/megatron_utils/model.py:23-24, checkpoint.py:7 and model_provider.py import megatron.training
# (Megatron-LM's training package, not in megatron-core's wheel); train_one_step reads get_args() alone (model.py:550).
# slime/observability/logging_utils.py:3 imports wandb and slime/utils/memory_utils.py psutil at module level; the step
# logs nothing. Each is an empty package whose every other attribute fails loudly when called.
STUBBED = ("megatron.training", "wandb", "psutil")


def _refusing(module: str) -> Callable[[str], Any]:
    def attribute(name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)

        def refuse(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError(f"{module}.{name} is stubbed in slime's step test; the step must not call it")

        refuse.__name__ = name
        return refuse

    return attribute


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if any(name == root or name.startswith(root + ".") for root in STUBBED):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = _refusing(spec.name)  # type: ignore[method-assign]  (PEP 562 module attribute hook)
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


def cpu_device() -> CudaToCpu:
    """megatron-core 0.16.1 names the GPU when it makes tensors: pipeline_parallel/schedules.py:596
    (``total_num_tokens``), distributed/param_and_grad_buffer.py:783-806 (the grad buffer, on
    ``torch.cuda.current_device()``), optimizer/optimizer.py:473-485 and :1141 (the loss scale and overflow buffers),
    optimizer/clip_grads.py:90-115 (the grad norm). Here they are made on the CPU. It also checks the type by name:
    clip_grads.py:167 asserts ``param.grad.type() == 'torch.cuda.FloatTensor'`` (and optimizer/optimizer.py:671-699
    sorts parameters by those names): a CPU tensor's ``type()`` answers with its CUDA name."""
    return CudaToCpu(cuda_type_names=True)


def _cpu_accelerator() -> Any:
    """slime/utils/accelerator/__init__.py:209 (``set_accelerator``), slime's hook for another backend: a CPU one, so
    that slime's own device calls (slime/backends/megatron_utils/data.py:91, ``accelerator.device()`` for the packed
    sequences' ``cu_seqlens``; ``current_device()`` in cp_utils.py) name the CPU."""
    from slime.utils.accelerator import Accelerator

    class CPUAccelerator(Accelerator):
        name = "cpu"
        device_type = "cpu"
        communication_backend_name = "gloo"

        def is_available(self) -> bool:
            return True

        def device(self, index: Any = None) -> torch.device:
            return torch.device("cpu")

        def device_name(self, index: Any = None) -> str:
            return "cpu"

        def set_device(self, index: Any) -> None:
            return None

        def current_device(self) -> str:
            return "cpu"

        def device_count(self) -> int:
            return 1

        def synchronize(self, device: Any = None) -> None:
            return None

        def current_stream(self, device: Any = None) -> None:
            return None

        def empty_cache(self) -> None:
            return None

        def mem_get_info(self, device: Any = None) -> tuple[int, int]:
            return (0, 0)

        def memory_allocated(self, device: Any = None) -> int:
            return 0

        def memory_reserved(self, device: Any = None) -> int:
            return 0

    return CPUAccelerator()


def install(get_args: Callable[[], Any]) -> None:
    """The process-wide shims, in a process that runs slime's step and nothing else. ``get_args``: what
    ``megatron.training.global_vars.get_args`` returns (slime's ``args``)."""
    path = slime_path()
    if path is None:
        raise RuntimeError(SKIP_REASON)
    if path not in sys.path:
        sys.path.insert(0, path)
    sys.meta_path.insert(0, _StubFinder())
    import megatron.training.global_vars as global_vars

    global_vars.get_args = get_args  # type: ignore[attr-defined]  (the stub package's one real attribute)
    # megatron-core 0.16.1 distributed/param_and_grad_buffer.py:783-806 allocates the grad buffer on
    # torch.cuda.current_device(), which a CPU build of torch refuses; the mode above maps the string to the CPU.
    torch.cuda.current_device = lambda: "cuda"  # type: ignore[assignment]
    # slime/utils/ppo_utils.py:11, :124, :151 wrap compute_approx_kl, compute_policy_loss and compute_cispo_loss in
    # torch.compile(dynamic=True); on a CPU that compiles C++ per process (tens of seconds). They run eagerly: the same
    # operations, unfused.
    import torch._dynamo.config as dynamo_config

    dynamo_config.disable = True
    from slime.utils import accelerator

    accelerator.set_accelerator(_cpu_accelerator())
