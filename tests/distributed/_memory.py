"""Allocation accounting on CPU without tracemalloc: a dispatch mode that tracks live tensor storage bytes."""

from __future__ import annotations

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveStorageBytes(TorchDispatchMode):
    """Counts the bytes of every storage created by an op inside the mode while it is alive; records the peak.

    Storages are keyed by data pointer and released when their weak reference expires (checked before every op, which
    is where an allocation could happen). Storages created outside the mode (inputs) are not counted.
    """

    def __init__(self):
        super().__init__()
        self._live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.current = 0
        self.peak = 0

    def _sweep(self) -> None:
        for key, (ref, nbytes) in list(self._live.items()):
            if ref.expired():
                del self._live[key]
                self.current -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self._sweep()
        out = func(*args, **(kwargs or {}))
        # views and in-place results share an input's storage: not an allocation
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        inputs = {t.untyped_storage().data_ptr() for t in tensors}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key, nbytes = storage.data_ptr(), storage.nbytes()
                if nbytes and key not in self._live and key not in inputs:
                    self._live[key] = (StorageWeakRef(storage), nbytes)
                    self.current += nbytes
        self.peak = max(self.peak, self.current)
        return out


class SavedTensorBytes(torch.autograd.graph.saved_tensors_hooks):
    """Sums the bytes of tensors saved for backward, skipping those that share storage with ``exclude`` tensors."""

    def __init__(self, *exclude: torch.Tensor):
        self.nbytes = 0
        skip = {t.untyped_storage().data_ptr() for t in exclude}

        def pack(t: torch.Tensor):
            if t.untyped_storage().data_ptr() not in skip:
                self.nbytes += t.untyped_storage().nbytes()
            return t

        super().__init__(pack, lambda t: t)
