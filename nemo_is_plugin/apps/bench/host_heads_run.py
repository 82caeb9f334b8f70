"""The measurement loop of ``nemo-is bench --host-heads`` (the heads and their inputs: :mod:`.host_heads`).

Per model shape, in one process: the bare GEMM and every head are warmed up (a head that raises is recorded as failed
with its error, and not timed), each gets one memory-tracked call, then ``repeats`` rounds each time every job once
(so that slow drifts of the device hit all of them alike); the errors come from separate calls on ``ref_tokens``
tokens against an fp32 (CPU: fp64) reference of the same inputs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import torch

from nemo_is_plugin.apps.bench.device import BenchDevice
from nemo_is_plugin.apps.bench.host_heads import (
    HOST_OF,
    HostHeadsConfig,
    head_errors,
    head_job,
    load_hosts,
    make_inputs,
    process_group,
    reference,
)
from nemo_is_plugin.apps.bench.shapes import ModelShape
from nemo_is_plugin.kernels.chunk_math import record_backends, triton_fallback_reason

Progress = Callable[[str], None]


def count_steps(cfg: HostHeadsConfig) -> int:
    return len(cfg.shapes) * (len(cfg.heads) + 2)


def _failure(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"


def _heads_here(cfg: HostHeadsConfig, hosts: dict) -> list[str]:
    """The configured heads whose host imported (the plugin's always do)."""
    return [h for h in cfg.heads if h not in HOST_OF or HOST_OF[h] in hosts]


def bench_shape(cfg: HostHeadsConfig, dev: BenchDevice, shape: ModelShape, hosts: dict, group, progress) -> list[dict]:
    inp = make_inputs(shape, cfg.tokens, cfg.batch, cfg.tp, dev)
    x, w = inp.hidden.reshape(-1, inp.hidden.shape[-1]), inp.weight
    jobs: dict[str, Callable[[], Any]] = {"matmul": lambda: torch.mm(x, w.t())}
    rows: dict[str, dict] = {}
    for name in _heads_here(cfg, hosts):
        jobs[name] = head_job(name, inp, hosts, cfg, group)
    for name, job in list(jobs.items()):
        progress(f"{shape.name}: {name}")
        row = rows.setdefault(name, {"model": shape.name, "head": name, "tokens": cfg.tokens, "failed": {}})
        try:
            for _ in range(cfg.warmup):
                job()
            with record_backends() as used:
                measured = dev.measure_memory(job)
            row.update(peak_bytes=measured.peak_bytes, backend="+".join(sorted(used)) or None)
        except Exception as exc:  # a head that raises is reported failed, the others are still measured
            row["failed"]["time"] = _failure(exc)
            del jobs[name]
            dev.release_cached()
    progress(f"{shape.name}: timing {len(jobs)} jobs x {cfg.repeats} rounds")
    times: dict[str, list[float]] = {name: [] for name in jobs}
    for _ in range(cfg.repeats):
        for name, job in jobs.items():
            times[name].append(dev.time_call(job))
    gemm = dev.summarise(times["matmul"]) if times.get("matmul") else None
    for name, seconds in times.items():
        t = dev.summarise(seconds)
        rows[name].update(fwdbwd_s=t, ratio=None if not gemm else t / gemm)
    progress(f"{shape.name}: errors on {cfg.ref_tokens} tokens")
    _add_errors(cfg, dev, shape, hosts, group, rows)
    for row in rows.values():
        row.update(hidden=shape.hidden, vocab=shape.vocab // cfg.tp, gemm_s=gemm)
    dev.release_cached()
    return list(rows.values())


def _add_errors(cfg, dev: BenchDevice, shape: ModelShape, hosts: dict, group, rows: dict[str, dict]) -> None:
    inp = make_inputs(shape, cfg.ref_tokens, cfg.batch, cfg.tp, dev, seed=1)
    acc = torch.float32 if dev.is_cuda else torch.float64
    ref = reference(inp, cfg.temperature, acc)
    for name, row in rows.items():
        if name == "matmul" or row["failed"]:
            continue
        try:
            row.update(head_errors(name, head_job(name, inp, hosts, cfg, group)(), inp, ref))
        except Exception as exc:
            row["failed"]["errors"] = _failure(exc)


def run_host_heads(cfg: HostHeadsConfig, progress: Progress | None = None) -> dict:
    """Measure every head on every shape; the result is JSON-ready (rows, config, machine, hosts, skipped)."""
    progress = progress or (lambda label: None)
    dev = BenchDevice.resolve(cfg.device, cfg.dtype)
    hosts, info, skipped = load_hosts(cfg)
    group = process_group(dev) if "nemo_rl" in hosts or "plugin_nemo_rl" in cfg.heads else None
    rows: list[dict] = []
    for shape in cfg.shapes:
        rows += bench_shape(cfg, dev, shape, hosts, group, progress)
    config = asdict(cfg)
    config["shapes"] = [asdict(s) for s in cfg.shapes]
    config.update(device=dev.device.type, dtype=str(dev.dtype).removeprefix("torch."), quick=cfg.quick_run)
    return {
        "kind": "host_heads",
        "config": config,
        "machine": dev.describe(),
        "hosts": info,
        "skipped": skipped,
        "rows": rows,
        "triton_fallback": triton_fallback_reason(),
    }


__all__ = ["bench_shape", "count_steps", "run_host_heads"]
