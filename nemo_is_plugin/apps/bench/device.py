"""Where the benchmark runs: device, input dtype, and the two device-specific measurements (time, peak memory).

Everything that differs between a CPU and a CUDA run lives here, so the rest of the benchmark is one code path:

- timing: CPU ``time.perf_counter`` around the call; CUDA ``torch.cuda.Event`` pairs recorded around it, read after
  a synchronize (the call's kernels, not its launch). Rounds are summarised by the minimum on CPU (a shared machine:
  the least disturbed round) and by the median on CUDA (a dedicated device: the typical round);
- peak memory above what exists before the call: CPU the tensor-storage tracker of :mod:`bench.memory` (+ RSS);
  CUDA ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``, minus ``memory_allocated`` at the start
  (the caching allocator's own slack is not counted, as on CPU);
- the machine description written into every result (device name, torch / triton / CUDA versions, date).
"""

from __future__ import annotations

import datetime
import gc
import importlib
import importlib.util
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from nemo_is_plugin.apps.bench.memory import RssPeak, TensorMemoryTracker

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "float64": torch.float64,
    "fp64": torch.float64,
}
DEVICE_TYPES = ("cpu", "cuda")


@dataclass
class Measured:
    """One memory-tracked call: its wall time (tracking included), peak bytes above the start, RSS cross-check."""

    seconds: float
    peak_bytes: int
    rss_bytes: int | None


def parse_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose from {sorted(DTYPES)}")
    return DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def clocked(fn: Callable[[], object], clock: Callable[[], float]) -> float:
    """Seconds of ``clock`` during one call of ``fn`` (its result is dropped), the collector paused: like timeit, no
    collector pause inside a timed call."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        start = clock()
        fn()
        return clock() - start
    finally:
        if enabled:
            gc.enable()


@dataclass(frozen=True)
class BenchDevice:
    """The device the inputs live on and their dtype (the LM head's and the hidden states')."""

    device: torch.device
    dtype: torch.dtype

    @classmethod
    def resolve(cls, device: str = "cpu", dtype: str | None = None) -> BenchDevice:
        """``device`` "cpu" | "cuda" (| "cuda:N"); ``dtype`` None = float32 on CPU, bfloat16 on CUDA."""
        dev = torch.device(device)
        if dev.type not in DEVICE_TYPES:
            raise ValueError(f"device must be one of {list(DEVICE_TYPES)} (or cuda:N), got {device!r}")
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(
                "device 'cuda' requested but torch.cuda.is_available() is False on this machine "
                f"(torch {torch.__version__}); run with --device cpu"
            )
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        default = torch.bfloat16 if dev.type == "cuda" else torch.float32
        return cls(dev, default if dtype is None else parse_dtype(dtype))

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    def synchronize(self) -> None:
        if self.is_cuda:
            torch.cuda.synchronize(self.device)

    def time_call(self, fn: Callable[[], object]) -> float:
        """Seconds of one call of an already warm ``fn`` (its result is dropped)."""
        if self.is_cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.synchronize()
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        return clocked(fn, time.perf_counter)

    def summarise(self, seconds: list[float]) -> float:
        """The reported time of several rounds: median on CUDA, minimum on the shared CPU."""
        return statistics.median(seconds) if self.is_cuda else min(seconds)

    @property
    def statistic(self) -> str:
        return "median" if self.is_cuda else "best"

    def recorded(self) -> dict[str, str]:
        """What a run's ``config`` records of the device: its type, the dtype and the statistic of the rounds."""
        return dict(device=self.device.type, dtype=dtype_name(self.dtype), statistic=self.statistic)

    def measure_memory(self, fn: Callable[[], object]) -> Measured:
        """Peak bytes allocated above the start during one call of ``fn`` (its result is dropped)."""
        gc.collect(1)  # young cyclic garbage (tensors of the previous run); a full collection costs ~0.3 s on CPU
        if self.is_cuda:
            self.synchronize()
            torch.cuda.reset_peak_memory_stats(self.device)
            base = torch.cuda.memory_allocated(self.device)
            start = time.perf_counter()
            fn()
            self.synchronize()
            seconds = time.perf_counter() - start
            return Measured(seconds, torch.cuda.max_memory_allocated(self.device) - base, None)
        start = time.perf_counter()
        with RssPeak() as rss, TensorMemoryTracker() as mem:
            fn()
        return Measured(time.perf_counter() - start, mem.peak, rss.delta)

    def release_cached(self) -> None:
        """Hand freed blocks back (between shapes / after an out-of-memory), so the next peak starts clean."""
        gc.collect()
        if self.is_cuda:
            torch.cuda.empty_cache()

    def describe(self) -> dict:
        """Machine facts for the result: device type and name, dtype, versions, date."""
        info: dict[str, Any] = dict(
            device=self.device.type,
            dtype=dtype_name(self.dtype),
            torch=torch.__version__,
            python=platform.python_version(),
            date=datetime.date.today().isoformat(),
            cpu=_cpu_name(),
            triton=_version("triton"),
        )
        if self.is_cuda:
            props = torch.cuda.get_device_properties(self.device)
            info.update(
                device_name=props.name, cuda=torch.version.cuda, device_memory_gib=round(props.total_memory / 2**30, 1)
            )
        else:
            info["device_name"] = info["cpu"]
        return info


def _cpu_name() -> str:
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as fh:
            return next((line.split(":", 1)[1].strip() for line in fh if line.startswith("model name")), name)
    except OSError:
        return name


def _version(module: str) -> str | None:
    if importlib.util.find_spec(module) is None:
        return None
    try:
        return getattr(importlib.import_module(module), "__version__", "unknown")
    except Exception:  # an installed package that fails to import (e.g. no driver): report it as unusable
        return None


__all__ = ["BenchDevice", "DEVICE_TYPES", "DTYPES", "Measured", "clocked", "dtype_name", "parse_dtype"]
