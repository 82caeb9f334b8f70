"""CPU-side checks for GPU bugs: a guard against tensors created without a device, and a host-sync counter.

Every user trains on GPUs while CI runs on CPUs, where a tensor created without ``device=`` silently lands on the
same device as the inputs. Two tools make that class of bug visible on a CPU:

``device_guard()``
    While active, a factory call (``torch.zeros / ones / empty / full / tensor / as_tensor / arange / linspace /
    eye / rand* / ...``, the list ``torch.set_default_device`` itself redirects) without an explicit ``device``
    raises :class:`DeviceLessTensorError`, naming the function and the calling line. ``*_like`` / ``new_*`` calls
    and ``torch.as_tensor(<tensor>)`` keep their input's device and are allowed. Underneath, the default device is
    ``meta``: anything the factory list misses lands on ``meta`` and fails at its first use with a CPU input.
    The inputs stay on CPU, so the values the guarded call returns are the real ones and can be compared with an
    unguarded call. What the guard cannot see: an explicit ``device="cpu"`` (a CPU run cannot tell it from the
    inputs' device; the package has none, tests/test_device_guard.py checks its source for it).

``count_host_syncs()``
    Records every operation that makes the host wait for the device: ``.item()``, ``bool / float / int`` of a
    tensor (``if t:``), ``.tolist()``, ``.cpu()`` / ``.numpy()``, ``nonzero``, ``masked_select``, ``unique``, boolean
    indexing, ``repeat_interleave`` without ``output_size``, ``torch.equal`` / ``allclose``. On a CPU these cost
    nothing, which is why a count is the only way to keep them out of the hot path in CI. Each record carries the
    package source line that triggered it.

Both are context managers, used around building *and* calling the loss (and its backward), e.g.::

    with device_guard():
        loss, metrics = build_loss_fn(cfg)(x, data, n_seq, n_tok)
        loss.backward()
"""

from __future__ import annotations

import contextlib
import traceback
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

PACKAGE_DIR = Path(__file__).resolve().parents[2] / "nemo_is_plugin"
_THIS_FILE = Path(__file__).resolve()

# The constructors torch.set_default_device redirects (torch/utils/_device.py), with a fixed fallback list for torch
# versions that lack the private helper.
try:
    from torch.utils._device import _device_constructors

    FACTORIES = frozenset(_device_constructors())
except ImportError:  # pragma: no cover - older / newer torch
    FACTORIES = frozenset(
        getattr(torch, n)
        for n in (
            "arange",
            "as_tensor",
            "asarray",
            "empty",
            "empty_strided",
            "eye",
            "full",
            "linspace",
            "logspace",
            "ones",
            "rand",
            "randint",
            "randn",
            "randperm",
            "range",
            "scalar_tensor",
            "tensor",
            "zeros",
        )
    )
# These keep the device of a tensor argument.
_KEEP_INPUT_DEVICE = frozenset(f for f in (torch.as_tensor, torch.asarray) if f in FACTORIES)


class DeviceLessTensorError(RuntimeError):
    """A tensor factory was called without ``device=`` inside :func:`device_guard`."""


def _caller() -> str:
    """The innermost stack frame outside torch and this module: the line that made the call."""
    for frame in reversed(traceback.extract_stack()):
        path = Path(frame.filename).resolve()
        if path == _THIS_FILE or "/torch/" in frame.filename:
            continue
        return f"{frame.filename}:{frame.lineno} ({frame.line})"
    return "<unknown>"


class _RejectDeviceLessFactories(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in FACTORIES and kwargs.get("device") is None:
            if func in _KEEP_INPUT_DEVICE and args and isinstance(args[0], torch.Tensor):
                # as_tensor(<tensor>) keeps the tensor's device; say so, or the meta default device would move it.
                kwargs = {**kwargs, "device": args[0].device}
            else:
                name = getattr(func, "__name__", str(func))
                raise DeviceLessTensorError(
                    f"torch.{name} called without device= at {_caller()}: pass the device of an input tensor "
                    "(or use a Python scalar / *_like / new_* instead)"
                )
        return func(*args, **kwargs)


@contextlib.contextmanager
def device_guard() -> Iterator[None]:
    """Fail any tensor creation that does not name its device (see the module docstring)."""
    with torch.device("meta"), _RejectDeviceLessFactories():
        yield


# ---------------------------------------------------------------------------------------------------- host syncs
@dataclass
class SyncRecord:
    """One host synchronisation: the op, and where: ``path:line (code)``, the package line when there is one
    (``file`` / ``function``: that line's file name and function, None outside the package)."""

    op: str
    where: str
    file: str | None = None
    function: str | None = None

    def __str__(self) -> str:
        return f"{self.op} at {self.where}"


@dataclass
class HostSyncs:
    """The host synchronisations seen inside :func:`count_host_syncs`."""

    records: list[SyncRecord] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.records)

    def __str__(self) -> str:
        return "\n".join(map(str, self.records)) or "(none)"

    def from_files(self, files: Iterable[str]) -> list[SyncRecord]:
        """The records made by package lines of the files named ``files`` (file names, e.g. ``fused_linear.py``)."""
        names = set(files)
        return [r for r in self.records if r.file in names]


def _sync_record(op: str) -> SyncRecord:
    """``op`` at the innermost stack frame in the package (else the innermost outside torch and this module)."""
    fallback = None
    for frame in reversed(traceback.extract_stack()):
        path = Path(frame.filename).resolve()
        if path == _THIS_FILE or "/torch/" in frame.filename:
            continue
        where = (
            f"{path.relative_to(PACKAGE_DIR.parent) if PACKAGE_DIR in path.parents else frame.filename}:"
            f"{frame.lineno} ({frame.line})"
        )
        if PACKAGE_DIR in path.parents:
            return SyncRecord(op, where, path.name, frame.name)
        fallback = fallback or where
    return SyncRecord(op, fallback or "<unknown>")


# aten ops whose CUDA kernels copy a result to the host before they return.
_SYNCING_ATEN = {
    "_local_scalar_dense",  # .item(), bool(t), float(t), int(t), t.__index__()
    "nonzero",
    "argwhere",
    "masked_select",
    "unique",
    "_unique",
    "_unique2",
    "unique_dim",
    "unique_consecutive",
    "equal",
    "allclose",
    "is_nonzero",
}
# Python-level tensor methods that copy to the host without a syncing aten op on a CPU tensor.
_SYNCING_METHODS = {torch.Tensor.tolist, torch.Tensor.cpu, torch.Tensor.numpy}


def _has_bool_index(indices) -> bool:
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ())


class _DispatchCounter(TorchDispatchMode):
    def __init__(self, syncs: HostSyncs):
        super().__init__()
        self.syncs = syncs

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        syncs = name in _SYNCING_ATEN
        if name in ("index", "index_put", "index_put_", "_index_put_impl_") and len(args) > 1:
            syncs = _has_bool_index(args[1])  # boolean indexing runs nonzero inside the kernel
        if name == "repeat_interleave" and func._overloadname in ("Tensor", "self_Tensor"):
            syncs = kwargs.get("output_size") is None  # the output length is the sum of the repeats
        if syncs:
            self.syncs.records.append(_sync_record(f"aten.{name}"))
        return func(*args, **kwargs)


class _MethodCounter(TorchFunctionMode):
    def __init__(self, syncs: HostSyncs):
        super().__init__()
        self.syncs = syncs

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _SYNCING_METHODS:
            self.syncs.records.append(_sync_record(f"Tensor.{func.__name__}"))
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def count_host_syncs() -> Iterator[HostSyncs]:
    """Record the host synchronisations of the code inside (see the module docstring)."""
    syncs = HostSyncs()
    with _MethodCounter(syncs), _DispatchCounter(syncs):
        yield syncs


# ---------------------------------------------------------------------------------------------------- comparisons
def assert_identical(got, want, path: str = "result") -> None:
    """``got`` equals ``want`` exactly (tensors, dicts, sequences, numbers; NaN equals NaN): the guard and the sync
    counter must not change a single bit of what they watch."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), f"{path}: {type(got).__name__} is not a tensor"
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True, msg=lambda m: f"{path}: {m}")
    elif isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys(), f"{path}: keys differ"
        for k in want:
            assert_identical(got[k], want[k], f"{path}[{k!r}]")
    elif isinstance(want, (list, tuple)):
        assert isinstance(got, (list, tuple)) and len(got) == len(want), f"{path}: lengths differ"
        for i, (a, b) in enumerate(zip(got, want)):
            assert_identical(a, b, f"{path}[{i}]")
    elif isinstance(want, float) and want != want:
        assert isinstance(got, float) and got != got, f"{path}: {got!r} is not NaN"
    else:
        assert got == want, f"{path}: {got!r} != {want!r}"


def run_guarded_and_plain(fn):
    """``(guarded, plain)`` results of ``fn()``: once inside :func:`device_guard`, once outside."""
    plain = fn()
    with device_guard():
        guarded = fn()
    return guarded, plain
