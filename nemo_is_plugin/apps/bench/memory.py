"""Peak memory of a region of torch code on CPU, measured two ways.

1. ``TensorMemoryTracker`` (the number the benchmark reports): a ``TorchDispatchMode`` that sees every tensor an op
   returns, counts the bytes of each *new* storage (one not among the op's inputs and not already counted) and
   uncounts them when the storage is freed (a weakref finalizer on the storage, which torch keeps alive exactly as
   long as any tensor uses it). Counted: forward activations, tensors saved for backward, workspaces, gradients and
   everything the autograd engine allocates on this thread. Not counted: storages that existed before the region
   (the inputs, parameters: the result is an *increase over the inputs*), and memory a kernel allocates without
   returning it as a tensor (BLAS packing buffers, a few MB). Deterministic and independent of the allocator.
2. ``RssPeak``: the process's peak resident set size (``VmHWM``) over the region, reset first through
   ``/proc/self/clear_refs``; minus the RSS at the start. What the OS saw, including allocator slack and untracked
   buffers; noisy (glibc keeps small freed blocks, pages of reused buffers stay resident) and Linux-only. Reported
   next to (1) as a cross-check, ``None`` where unavailable.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


def _storages(tree) -> list[torch.UntypedStorage]:
    return [t.untyped_storage() for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


class TensorMemoryTracker(TorchDispatchMode):
    """Tracks live bytes of tensor storages created inside the ``with`` block; ``peak`` is the high-water mark.

    Usage: ``with TensorMemoryTracker() as mem: run(); print(mem.peak, mem.current)``.
    """

    def __init__(self) -> None:
        super().__init__()
        self._live: dict[int, int] = {}
        self.current = 0
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {s.data_ptr() for s in _storages((args, kwargs))}
        for storage in _storages(out):
            key, nbytes = storage.data_ptr(), storage.nbytes()
            if nbytes == 0 or key in inputs or key in self._live:
                continue  # in-place / out= results, views, and storages already counted
            self._live[key] = nbytes
            self.current += nbytes
            self.peak = max(self.peak, self.current)
            weakref.finalize(storage, self._release, key)
        return out

    def _release(self, key: int) -> None:
        self.current -= self._live.pop(key, 0)


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


class RssPeak:
    """``with RssPeak() as rss: ...`` then ``rss.delta`` = peak RSS during the block minus RSS at its start (bytes).

    ``delta`` is None when ``/proc/self/clear_refs`` cannot reset the high-water mark (not Linux, no permission).
    """

    def __init__(self) -> None:
        self.delta: int | None = None
        self._start: int | None = None

    def __enter__(self) -> RssPeak:
        try:
            with open("/proc/self/clear_refs", "w") as fh:
                fh.write("5")  # resets VmHWM to the current RSS
            self._start = _status_kib("VmRSS")
        except OSError:
            self._start = None
        return self

    def __exit__(self, *exc) -> None:
        peak = _status_kib("VmHWM")
        if self._start is not None and peak is not None:
            self.delta = max(0, peak - self._start) * 1024


__all__ = ["RssPeak", "TensorMemoryTracker"]
