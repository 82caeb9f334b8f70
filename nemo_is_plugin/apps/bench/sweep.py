"""Peak memory of forward+backward against the token count (the CPU run's memory sweep) and at the memory target's
token count itself (``direct_memory``), one tracked run per point."""

from __future__ import annotations

from collections.abc import Callable

from nemo_is_plugin.apps.bench.device import BenchDevice
from nemo_is_plugin.apps.bench.jobs import bench_loss_fn, fwd_bwd_job
from nemo_is_plugin.apps.bench.paths import LogprobPath
from nemo_is_plugin.apps.bench.problem import HeadProblem, make_problem
from nemo_is_plugin.apps.bench.shapes import BenchConfig

Progress = Callable[[str], None]


def _runnable(name: str, paths: dict[str, LogprobPath]) -> bool:
    path = paths.get(name)
    return path is not None and path.unavailable is None and path.fwdbwd_unavailable is None


def memory_sweep(cfg: BenchConfig, dev: BenchDevice, paths: dict[str, LogprobPath], progress: Progress) -> list[dict]:
    """Peak bytes of forward+backward per path and token count at ``cfg.memory_shape`` (one run each)."""
    hidden, vocab = cfg.memory_shape
    loss_fn = bench_loss_fn()
    points = []
    for tokens in cfg.memory_tokens:
        problem = make_problem(
            cfg.batch, tokens // cfg.batch + 1, hidden, vocab, seed=1, dtype=dev.dtype, device=dev.device
        )
        for name in cfg.paths:
            progress(f"memory sweep: {name} at {tokens} tokens")
            if _runnable(name, paths):
                points.append(memory_point(dev, name, fwd_bwd_job(paths[name], problem, loss_fn), problem))
    return points


def memory_point(dev: BenchDevice, name: str, run: Callable[[], object], problem: HeadProblem) -> dict:
    """One memory-tracked forward+backward of ``run`` on ``problem``, as a sweep / direct-measurement point."""
    m = dev.measure_memory(run)
    hidden, vocab = problem.weight.shape[1], problem.weight.shape[0]
    return dict(
        path=name,
        tokens=problem.num_tokens,
        hidden=hidden,
        vocab=vocab,
        peak_bytes=m.peak_bytes,
        rss_bytes=m.rss_bytes,
        seconds=m.seconds,
    )


def direct_memory(cfg: BenchConfig, dev: BenchDevice, paths: dict[str, LogprobPath], progress: Progress) -> list[dict]:
    """Peak bytes of forward+backward at ``cfg.extrapolate_tokens`` itself, for ``direct_memory_paths`` (the CPU
    memory target is checked on these measurements; the sweep's extrapolation is the cross-check)."""
    if not cfg.memory_tokens:
        return []
    hidden, vocab = cfg.memory_shape
    loss_fn = bench_loss_fn()
    problem = make_problem(
        cfg.batch, cfg.extrapolate_tokens // cfg.batch + 1, hidden, vocab, seed=1, dtype=dev.dtype, device=dev.device
    )
    points = []
    for name in [p for p in cfg.direct_memory_paths if p in cfg.paths]:
        progress(f"memory at {cfg.extrapolate_tokens} tokens: {name}")
        if _runnable(name, paths):
            points.append(memory_point(dev, name, fwd_bwd_job(paths[name], problem, loss_fn), problem))
    return points


def count_sweep_steps(cfg: BenchConfig) -> int:
    direct = len([p for p in cfg.direct_memory_paths if p in cfg.paths]) if cfg.memory_tokens else 0
    return len(cfg.memory_tokens) * len(cfg.paths) + direct


__all__ = ["count_sweep_steps", "direct_memory", "memory_point", "memory_sweep"]
