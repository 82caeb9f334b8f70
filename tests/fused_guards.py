"""Two CPU-side guards for device-clean code: count host synchronisations, reject tensor factories without a device.

- ``SyncRecorder``: a dispatch mode + function mode that records every op that forces a GPU->host synchronisation on
  CUDA (``item`` / ``bool`` / ``float`` -> ``_local_scalar_dense``, ``nonzero``, boolean-mask indexing,
  ``masked_select``, ``unique``, ``repeat_interleave`` without ``output_size``, ``equal``, ``tolist``, ``cpu``,
  ``numpy``), each with the innermost ``nemo_is_plugin`` frame that caused it. On CPU these ops cost nothing, but the
  same code on a GPU stalls the host, so counting them on CPU is how CI proves a loop is sync-free.
- ``FactoryGuard``: a function mode that raises when a tensor factory (``torch.zeros``, ``tensor``, ``arange``, ...)
  is called without ``device=`` from a frame in the guarded files: such a tensor lands on the default device (the CPU)
  whatever device the inputs are on. ``*_like`` / ``Tensor.new_*`` inherit the device and are fine.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Iterable, Optional

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

PACKAGE_DIR = str(Path(__file__).resolve().parents[1] / "nemo_is_plugin")

_SYNC_ATEN = {"_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique", "_unique2",
              "unique_consecutive", "unique_dim", "equal", "is_nonzero", "nonzero_static"}
FACTORIES = {torch.zeros, torch.ones, torch.full, torch.empty, torch.tensor, torch.arange, torch.as_tensor,
             torch.rand, torch.randn, torch.randint, torch.linspace, torch.logspace, torch.eye, torch.scalar_tensor,
             torch.empty_strided}


def package_frame() -> Optional[tuple[str, str, int]]:
    """(file name, function, line) of the innermost frame inside nemo_is_plugin, or None."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_filename.startswith(PACKAGE_DIR):
            return Path(frame.f_code.co_filename).name, frame.f_code.co_name, frame.f_lineno
        frame = frame.f_back
    return None


def _is_bool_index(indices) -> bool:
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ())


class _SyncDispatch(TorchDispatchMode):
    def __init__(self, events: list):
        super().__init__()
        self.events = events

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        sync = name in _SYNC_ATEN
        if name in ("index", "index_put", "index_put_", "_index_put_impl_") and len(args) > 1:
            sync = _is_bool_index(args[1])
        if name == "repeat_interleave" and isinstance(args[0], torch.Tensor) and len(args) > 1:
            sync = kwargs.get("output_size") is None and isinstance(args[1], torch.Tensor)
        if sync:
            self.events.append((name, package_frame()))
        return func(*args, **kwargs)


class _SyncFunctions(TorchFunctionMode):
    def __init__(self, events: list):
        super().__init__()
        self.events = events

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in ("tolist", "cpu", "numpy"):
            self.events.append((name, package_frame()))
        return func(*args, **(kwargs or {}))


class SyncRecorder:
    """``with SyncRecorder() as rec: ...``; ``rec.events`` = [(op, (file, function, line) | None)]."""

    def __init__(self) -> None:
        self.events: list = []
        self._modes = (_SyncFunctions(self.events), _SyncDispatch(self.events))

    def __enter__(self) -> "SyncRecorder":
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)

    def from_files(self, files: Iterable[str]) -> list:
        names = set(files)
        return [e for e in self.events if e[1] is not None and e[1][0] in names]


class FactoryGuard(TorchFunctionMode):
    """Raise on a tensor factory without ``device=`` called from one of ``files`` (file names inside the package;
    None = every package file)."""

    def __init__(self, files: Optional[Iterable[str]] = None):
        super().__init__()
        self.files = None if files is None else set(files)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in FACTORIES and kwargs.get("device") is None:
            harmless = func is torch.as_tensor and args and isinstance(args[0], torch.Tensor)
            caller = sys._getframe(1).f_code.co_filename
            guarded = caller.startswith(PACKAGE_DIR) and (self.files is None or Path(caller).name in self.files)
            if guarded and not harmless:
                raise AssertionError(f"torch.{func.__name__} without device= in {Path(caller).name}")
        return func(*args, **kwargs)
