"""Runs the benchmark: per model shape, the bare LM-head GEMM and every path, forward and forward+backward through
the plugin's loss; then (CPU runs) a memory sweep over token counts. Returns plain dicts (the JSON the report is built
from). Device-specific timing and memory live in :mod:`bench.device`; the same code runs on CPU and CUDA.

Per shape and path:
- ``fwd_s``: log-probs under ``no_grad`` (the old-policy / reference pass);
- ``fwdbwd_s``: log-probs -> ``ClippedPGLoss`` (GRPO + token TIS + k3 KL) -> ``backward()`` into hidden and weight;
- ``fwd_peak`` / ``fwdbwd_peak``: peak bytes above the inputs; ``fwdbwd_rss``: the RSS cross-check (CPU);
- ``loss_err`` / ``dx_err`` / ``dw_err``: the forward+backward's loss, dX and dW against the fp32 reference of the
  whole problem (:mod:`bench.reference`);
- ``lp_err`` / ``grad_err``: max |log-prob - float64 reference| and max relative error of ``d(-mean lp)/d hidden`` on
  the first ``ref_tokens`` tokens; ``loss_grad_err``: the loss's ``d/d hidden`` against the naive path in float64 on
  a ``ref_tokens``-token problem of the same shape (inputs in fp32).
The ``matmul`` row is the bare ``hidden @ W.T`` (forward) and its 3 GEMMs (forward+backward), timed in the same
rounds as the paths; ``loss`` is the loss epilogue alone (forward+backward on given log-probs).

``backend``: the chunk-math backend(s) the path's memory-tracked calls ran on (``torch``, ``triton``; None: no chunk
math, e.g. naive); ``results["triton_fallback"]`` is why ``auto`` fell back from Triton to torch in this run (None:
it did not). A path that cannot run here is listed in ``skipped`` with the reason. A measurement that raises (an
out-of-memory, a backend error) is recorded in its row's ``failed`` (``{measurement: error}``, the measurements of
``failures.MEASUREMENTS``) and the run goes on: a failure is never an empty cell.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from nemo_is_plugin.apps.bench.catalog import bench_paths
from nemo_is_plugin.apps.bench.device import BenchDevice, Measured
from nemo_is_plugin.apps.bench.jobs import BENCH_LOSS_CONFIG, Job, bench_loss_fn, fwd_bwd_job, matmul_jobs, path_jobs
from nemo_is_plugin.apps.bench.jobs import path_loss as _path_loss
from nemo_is_plugin.apps.bench.liger import liger_mean_logprob_grad
from nemo_is_plugin.apps.bench.measure import max_abs_err, max_rel_err, path_errors, reference_logprobs_and_grad
from nemo_is_plugin.apps.bench.paths import LogprobPath, lm_head_logits
from nemo_is_plugin.apps.bench.problem import HeadProblem, leaf_grad, make_problem
from nemo_is_plugin.apps.bench.reference import Reference, compare, reference_loss_and_grads
from nemo_is_plugin.apps.bench.shapes import BenchConfig, ModelShape
from nemo_is_plugin.apps.bench.sweep import count_sweep_steps, direct_memory, memory_sweep
from nemo_is_plugin.kernels.chunk_math import record_backends, triton_fallback_reason

Progress = Callable[[str], None]


def count_steps(cfg: BenchConfig) -> int:
    """Number of ``progress`` calls ``run_benchmark`` makes (for a progress bar)."""
    per_shape = 1 + 1 + len(cfg.paths) + cfg.repeats + 1  # reference, warm-ups (matmul, paths), rounds, errors
    return len(cfg.shapes) * per_shape + count_sweep_steps(cfg)


def result_row(shape: ModelShape, vocab: int, tokens: int, path: str, **values) -> dict:
    """One row of ``results.json``: every column present (None where not measured), ``values`` filled in."""
    base = dict(
        model=shape.name,
        hidden=shape.hidden,
        vocab=vocab,
        tokens=tokens,
        path=path,
        fwd_s=None,
        fwdbwd_s=None,
        fwd_peak=None,
        fwdbwd_peak=None,
        fwdbwd_rss=None,
        lp_err=None,
        grad_err=None,
        loss_grad_err=None,
        loss_err=None,
        dx_err=None,
        dw_err=None,
        backend=None,
        failed={},
    )
    base.update(values)
    return base


def _failure(exc: BaseException, where: str) -> str:
    first = (str(exc).strip().splitlines() or [""])[0][:300]
    return f"failed on {where}: {type(exc).__name__}: {first}"


def _check_against(ref: Reference) -> Callable[[object], dict]:
    """The error check of a forward+backward job's ``(loss, dX, dW)`` result against ``ref``."""

    def check(result: object) -> dict:
        if not (isinstance(result, tuple) and len(result) == 3):
            raise TypeError(f"a forward+backward job returns (loss, dX, dW), got {type(result).__name__}")
        loss, grad_hidden, grad_weight = result
        return compare(loss, grad_hidden, grad_weight, ref)

    return check


def _tracked_call(dev: BenchDevice, job: Job, warmup: int) -> tuple[Measured, object, set[str]]:
    """``warmup`` untracked calls, then one memory-tracked call: its measurement, result and chunk-math backends."""
    for _ in range(warmup):
        job()
    out: dict = {}
    with record_backends() as used:
        measured = dev.measure_memory(lambda: out.__setitem__("result", job()))
    return measured, out.get("result"), used


def _backend_label(used: set[str]) -> str | None:
    return "+".join(sorted(used)) or None


class _ShapeRun:
    """The jobs of one shape with their memory, errors, backends, timing rounds and failures."""

    def __init__(self, dev: BenchDevice, shape: ModelShape) -> None:
        self.dev, self.shape = dev, shape
        self.jobs: dict[tuple[str, str], Job] = {}
        self.memory: dict[tuple[str, str], Measured] = {}
        self.errors: dict[str, dict] = {}
        self.backends: dict[str, set[str]] = {}
        self.times: dict[tuple[str, str], list[float]] = {}
        self.failed: dict[str, dict[str, str]] = {}  # path -> {measurement: error}

    def fail(self, key: tuple[str, str], exc: BaseException) -> None:
        self.jobs.pop(key, None)
        self.times.pop(key, None)
        self.memory.pop(key, None)
        self.failed.setdefault(key[0], {})[key[1]] = _failure(exc, f"{self.shape.name} ({self.dev.device.type})")

    def warm_up(self, key: tuple[str, str], warmup: int, check: Callable[[object], dict] | None) -> None:
        try:
            self.memory[key], result, used = _tracked_call(self.dev, self.jobs[key], warmup)
            self.backends.setdefault(key[0], set()).update(used)
            if check is not None:
                self.errors[key[0]] = check(result)
            self.times[key] = []
        except Exception as exc:  # a backend or an out-of-memory: recorded in the row's `failed`, the run goes on
            self.fail(key, exc)
        self.dev.release_cached()

    def time_round(self) -> None:
        for key, fn in list(self.jobs.items()):
            try:
                self.times[key].append(self.dev.time_call(fn))
            except Exception as exc:
                self.fail(key, exc)
                self.dev.release_cached()

    def values(self, name: str) -> dict | None:
        """The row's measured values, its backend and failures; None when nothing of ``name`` was attempted."""
        keys = [k for k in self.times if k[0] == name and self.times[k]]
        if not keys and name not in self.failed:
            return None
        values: dict = dict(self.errors.get(name, {}))
        values.update(backend=_backend_label(self.backends.get(name, set())), failed=dict(self.failed.get(name, {})))
        for _, kind in keys:
            values[f"{kind}_s"] = self.dev.summarise(self.times[(name, kind)])
            values[f"{kind}_peak"] = self.memory[(name, kind)].peak_bytes
        if (name, "fwdbwd") in self.memory:
            values["fwdbwd_rss"] = self.memory[(name, "fwdbwd")].rss_bytes
        return values


def _shape_problem(
    cfg: BenchConfig, shape: ModelShape, vocab: int, dev: BenchDevice, tokens: int, *, seed: int, dtype: torch.dtype
) -> HeadProblem:
    """``tokens`` positions in ``cfg.batch`` sequences at the shape's hidden size and ``vocab`` (this TP rank's
    rows), on the device; prev / generation / reference log-probs near the model's own: ratios near 1, both sides of
    the clip hit."""
    seq_len = tokens // cfg.batch + 1
    return make_problem(
        cfg.batch, seq_len, shape.hidden, vocab, seed=seed, dtype=dtype, device=dev.device, base_logprobs="model"
    )


def bench_shape(
    shape: ModelShape,
    cfg: BenchConfig,
    dev: BenchDevice,
    paths: dict[str, LogprobPath],
    progress: Progress,
    skipped: dict[str, str],
) -> list[dict]:
    """Rows for one model shape: matmul, each path, the loss epilogue (see the module docstring); what could not be
    measured for a row is added to ``skipped`` with the reason.

    Every job first runs ``cfg.warmup`` times untracked and once memory-tracked (its loss and gradients are compared
    with the reference there); then ``repeats`` rounds time every job once each, and each job reports the
    device's summary of its rounds (CPU: best; CUDA: median): a load spike on a shared machine hits one round of a few
    jobs, not all repetitions of one job, and the matmul reference is timed in the same rounds as the paths.
    """
    vocab = shape.vocab // cfg.tp
    problem = _shape_problem(cfg, shape, vocab, dev, cfg.tokens, seed=0, dtype=dev.dtype)
    loss_fn = bench_loss_fn()
    progress(f"{shape.name}: fp32 reference of loss, dX, dW")
    ref = reference_loss_and_grads(problem, loss_fn)
    run = _ShapeRun(dev, shape)
    run.jobs.update(matmul_jobs(problem))
    for name in ["matmul", *cfg.paths]:
        progress(f"{shape.name}: warm-up + memory, {name}")
        path = paths.get(name)
        if path is not None and path.unavailable is None:
            run.jobs.update(path_jobs(path, problem, loss_fn))
        for key in [k for k in run.jobs if k[0] == name]:
            checks = path is not None and key[1] == "fwdbwd" and not path.own_loss
            run.warm_up(key, cfg.warmup, _check_against(ref) if checks else None)
    del ref
    for r in range(cfg.repeats):
        progress(f"{shape.name}: timing round {r + 1}/{cfg.repeats}")
        run.time_round()
    rows = []
    for name in ["matmul", *cfg.paths]:
        values = run.values(name)
        if values is not None:
            rows.append(result_row(shape, vocab, problem.num_tokens, name, **values))
    run.jobs.clear()

    progress(f"{shape.name}: float64 reference on a few tokens, loss epilogue")
    _add_errors(rows, problem, cfg, paths)
    _add_loss_errors(rows, shape, vocab, cfg, dev, paths, loss_fn, skipped)
    rows.append(_epilogue_row(shape, vocab, problem, cfg, dev, loss_fn))
    return rows


def _epilogue_row(
    shape: ModelShape, vocab: int, problem: HeadProblem, cfg: BenchConfig, dev: BenchDevice, loss_fn
) -> dict:
    """The loss epilogue alone: ``ClippedPGLoss`` forward+backward on given log-probs."""
    lp = torch.randn(problem.target.shape, device=problem.target.device).clamp(max=-0.01)
    given = dataclasses.replace(problem, hidden=lp)
    job = fwd_bwd_job(LogprobPath("loss", "the loss epilogue", lambda h, w_, t: h), given, loss_fn)
    try:
        measured, _, _ = _tracked_call(dev, job, cfg.warmup)
        seconds = dev.summarise([dev.time_call(job) for _ in range(max(1, cfg.repeats))])
    except Exception as exc:  # recorded in the row, the run goes on
        failed = {"fwdbwd": _failure(exc, f"{shape.name} ({dev.device.type})")}
        return result_row(shape, vocab, problem.num_tokens, "loss", failed=failed)
    return result_row(shape, vocab, problem.num_tokens, "loss", fwdbwd_s=seconds, fwdbwd_peak=measured.peak_bytes)


def _add_errors(rows: list[dict], problem: HeadProblem, cfg: BenchConfig, paths: dict[str, LogprobPath]) -> None:
    n = cfg.ref_tokens
    xs, ts, w = problem.hidden.reshape(-1, problem.hidden.shape[-1])[:n], problem.target.reshape(-1)[:n], problem.weight
    ref_lp, ref_grad = reference_logprobs_and_grad(xs, w, ts)
    for r in rows:
        path = paths.get(r["path"])
        try:
            if path is not None and path.fn is not None:
                r["lp_err"], r["grad_err"] = path_errors(path.fn, xs, w, ts, ref_lp, ref_grad)
            elif r["path"] == "liger":
                r["grad_err"] = max_rel_err(liger_mean_logprob_grad(xs[None], w, ts[None], ref_lp[None]), ref_grad)
            elif r["path"] == "matmul":
                logits = lm_head_logits(xs, w).float()
                r["lp_err"] = max_abs_err(torch.log_softmax(logits, -1).gather(-1, ts[:, None])[:, 0], ref_lp)
        except Exception as exc:  # a backend that ran the full problem but not this one: recorded in the row
            r["failed"]["reference"] = _failure(exc, f"{r['model']} float64 reference errors")


def _add_loss_errors(
    rows: list[dict],
    shape: ModelShape,
    vocab: int,
    cfg: BenchConfig,
    dev: BenchDevice,
    paths: dict[str, LogprobPath],
    loss_fn,
    skipped: dict[str, str],
) -> None:
    """``loss_grad_err``: max relative error of the benchmark loss's ``d loss / d hidden`` against the naive path in
    float64, on a ``ref_tokens``-token problem of the same shape in fp32 (this checks the algorithm, the full-size
    ``dx_err`` the precision)."""
    small = _shape_problem(cfg, shape, vocab, dev, cfg.ref_tokens, seed=2, dtype=torch.float32)

    def hidden_grad(path: LogprobPath, dtype: torch.dtype) -> torch.Tensor:
        h = small.hidden.detach().to(dtype).requires_grad_(True)
        _path_loss(path, small, loss_fn, h, small.weight.detach().to(dtype)).backward()
        return leaf_grad(h)

    ref = hidden_grad(paths["naive"], torch.float64)
    for r in rows:
        path = paths.get(r["path"])
        if path is None or path.own_loss or r["fwdbwd_s"] is None:
            continue
        if path.fp32_check_unavailable:
            skipped[f"{r['path']} loss gradient vs float64 ({r['model']})"] = path.fp32_check_unavailable
            continue
        try:
            r["loss_grad_err"] = max_rel_err(hidden_grad(path, torch.float32), ref)
        except Exception as exc:  # e.g. a bf16-only kernel: recorded in the row
            r["failed"]["loss_grad"] = _failure(exc, f"{r['model']} loss gradient vs naive float64")


def run_benchmark(cfg: BenchConfig, progress: Progress | None = None) -> dict:
    """Everything ``nemo-is bench`` reports, as a JSON-able dict: config, machine, rows, memory sweep, skipped."""
    progress = progress or (lambda _label: None)
    dev = BenchDevice.resolve(cfg.device, cfg.dtype)
    torch.set_num_threads(cfg.threads)
    paths = {p.name: p for p in bench_paths(cfg.chunk_size, dev.device)}
    skipped: dict[str, str] = {}
    for name in cfg.paths:
        path = paths[name]
        if path.unavailable:
            skipped[name] = path.unavailable
        elif path.fwdbwd_unavailable:
            skipped[f"{name} forward+backward"] = path.fwdbwd_unavailable
    rows = []
    for shape in cfg.shapes:
        rows += bench_shape(shape, cfg, dev, paths, progress, skipped)
        dev.release_cached()
    sweep = memory_sweep(cfg, dev, paths, progress)
    direct = direct_memory(cfg, dev, paths, progress)
    config = dict(
        tokens=cfg.tokens,
        batch=cfg.batch,
        tp=cfg.tp,
        chunk_size=cfg.chunk_size,
        repeats=cfg.repeats,
        paths=list(cfg.paths),
        ref_tokens=cfg.ref_tokens,
        memory_tokens=list(cfg.memory_tokens),
        memory_shape=list(cfg.memory_shape),
        extrapolate_tokens=cfg.extrapolate_tokens,
        direct_memory_paths=list(cfg.direct_memory_paths),
        shapes=[dict(name=s.name, hidden=s.hidden, vocab=s.vocab) for s in cfg.shapes],
        loss=BENCH_LOSS_CONFIG,
        warmup=cfg.warmup,
        quick=cfg.quick_run,
        **dev.recorded(),
    )
    machine = dict(dev.describe(), threads=cfg.threads)
    return dict(
        config=config,
        machine=machine,
        rows=rows,
        memory_sweep=sweep,
        memory_direct=direct,
        skipped=skipped,
        triton_fallback=triton_fallback_reason(),
    )


__all__ = ["BENCH_LOSS_CONFIG", "bench_shape", "count_steps", "run_benchmark"]
