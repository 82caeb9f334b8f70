"""Runs the benchmark: per model shape, the bare LM-head GEMM and every path, forward and forward+backward through
the plugin's loss; then a memory sweep over token counts. Returns plain dicts (the JSON the report is built from).

Per shape and path (times are best-of-``repeats`` after a memory-tracked warm-up):
- ``fwd_s``: log-probs under ``no_grad`` (the old-policy / reference pass);
- ``fwdbwd_s``: log-probs -> ``ClippedPGLoss`` (GRPO + token TIS + k3 KL) -> ``backward()`` into hidden and weight;
- ``fwd_peak`` / ``fwdbwd_peak``: peak tracked tensor bytes over the inputs; ``fwdbwd_rss``: the RSS cross-check;
- ``lp_err``: max |log-prob - float64 reference| and ``grad_err``: max relative error of ``d(-mean lp)/d hidden``,
  both on the first ``ref_tokens`` tokens.
The ``matmul`` row is the bare ``hidden @ W.T`` (forward) and its 3-GEMM autograd (forward+backward), timed in the
same rounds as the paths; ``loss`` is the loss epilogue alone (forward+backward on given log-probs).
"""

from __future__ import annotations

import datetime
import platform
from typing import Callable, Optional

import torch

from nemo_is_plugin.bench.liger import liger_fwd_bwd, liger_loss, liger_mean_logprob_grad, liger_unavailable_reason
from nemo_is_plugin.bench.measure import (
    best_time,
    max_abs_err,
    max_rel_err,
    measure,
    memory_only,
    path_errors,
    reference_logprobs_and_grad,
)
from nemo_is_plugin.bench.paths import LogprobPath, logprob_paths
from nemo_is_plugin.bench.problem import HeadProblem, make_problem
from nemo_is_plugin.bench.shapes import BenchConfig, ModelShape

# The loss every path's log-probs go through: GRPO-style clipped PG with token-level TIS and the default k3 KL.
BENCH_LOSS_CONFIG = dict(
    use_importance_sampling_correction=True,
    truncated_importance_sampling_type="tis",
    truncated_importance_sampling_ratio=2.0,
)

Progress = Callable[[str], None]


def count_steps(cfg: BenchConfig) -> int:
    """Number of ``progress`` calls ``run_benchmark`` makes (for a progress bar)."""
    per_shape = 1 + len(cfg.paths) + cfg.repeats + 1  # warm-ups (matmul, paths), timing rounds, errors + epilogue
    direct = len([p for p in cfg.direct_memory_paths if p in cfg.paths]) if cfg.memory_tokens else 0
    return len(cfg.shapes) * per_shape + len(cfg.memory_tokens) * len(cfg.paths) + direct


def _fwd_bwd(path: LogprobPath, problem: HeadProblem, loss_fn) -> Callable[[], None]:
    def run() -> None:
        h = problem.hidden.detach().requires_grad_(True)
        w = problem.weight.detach().requires_grad_(True)
        _path_loss(path, problem, loss_fn, h, w).backward()

    return run


def _path_loss(path: LogprobPath, problem: HeadProblem, loss_fn, h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    if path.loss is not None:
        return path.loss(loss_fn, problem, h, w)
    loss, _ = loss_fn(
        next_token_logprobs=path.fn(h, w, problem.target), data=problem.data,
        global_valid_seqs=problem.global_valid_seqs, global_valid_toks=problem.global_valid_toks,
    )
    return loss


def _liger_fwd_bwd(problem: HeadProblem) -> Callable[[], None]:
    module = liger_loss()

    def run() -> None:
        liger_fwd_bwd(problem, problem.hidden.detach().requires_grad_(True),
                      problem.weight.detach().requires_grad_(True), module)

    return run


def _row(shape: ModelShape, vocab: int, tokens: int, path: str, **values) -> dict:
    base = dict(model=shape.name, hidden=shape.hidden, vocab=vocab, tokens=tokens, path=path, fwd_s=None,
                fwdbwd_s=None, fwd_peak=None, fwdbwd_peak=None, fwdbwd_rss=None, lp_err=None, grad_err=None,
                loss_grad_err=None)
    base.update(values)
    return base


def _jobs(problem: HeadProblem, cfg: BenchConfig, loss_fn, paths: dict, skipped: dict) -> dict:
    """``{(path, "fwd" | "fwdbwd"): callable}`` for the bare matmul and every path of the run."""
    x, w = problem.hidden.reshape(-1, problem.hidden.shape[-1]), problem.weight
    upstream = torch.randn(x.shape[0], w.shape[0])  # the 3-GEMM reference's incoming gradient, made once

    def matmul_fwd_bwd() -> None:
        (x.detach().requires_grad_(True) @ w.detach().requires_grad_(True).t()).backward(upstream)

    jobs = {("matmul", "fwd"): lambda: torch.mm(x, w.t()), ("matmul", "fwdbwd"): matmul_fwd_bwd}
    for name in cfg.paths:
        if name == "liger":
            if not skipped.get("liger"):
                jobs[(name, "fwdbwd")] = _liger_fwd_bwd(problem)
            continue

        def forward(fn=paths[name].fn) -> None:
            with torch.no_grad():
                fn(problem.hidden, w, problem.target)

        if paths[name].times_forward:
            jobs[(name, "fwd")] = forward
        jobs[(name, "fwdbwd")] = _fwd_bwd(paths[name], problem, loss_fn)
    return jobs


def bench_shape(shape: ModelShape, cfg: BenchConfig, progress: Progress, skipped: dict) -> list[dict]:
    """Rows for one model shape: matmul, each path, the loss epilogue (see the module docstring).

    Every job first runs once under memory tracking (the warm-up); then ``repeats`` rounds time every job once each,
    and each job keeps its best round: a load spike on the shared machine hits one round of a few jobs, not all
    repetitions of one job, and the matmul reference is timed in the same rounds as the paths.
    """
    from nemo_is_plugin import build_loss_fn

    vocab = shape.vocab // cfg.tp
    problem = make_problem(cfg.batch, cfg.tokens // cfg.batch + 1, shape.hidden, vocab, seed=0)
    loss_fn = build_loss_fn(BENCH_LOSS_CONFIG)
    paths = {p.name: p for p in logprob_paths(cfg.chunk_size)}
    jobs = _jobs(problem, cfg, loss_fn, paths, skipped)

    memory = {}
    for name in ["matmul", *cfg.paths]:
        progress(f"{shape.name}: warm-up + memory, {name}")
        for key in [k for k in jobs if k[0] == name]:
            memory[key] = memory_only(jobs[key])
    best = dict.fromkeys(jobs, float("inf"))
    for r in range(cfg.repeats):
        progress(f"{shape.name}: timing round {r + 1}/{cfg.repeats}")
        for key, fn in jobs.items():
            best[key] = min(best[key], best_time(fn))

    rows = []
    for name in ["matmul", *[p for p in cfg.paths if (p, "fwdbwd") in jobs]]:
        values = {}
        for kind in ("fwd", "fwdbwd"):
            if (name, kind) in jobs:
                values[f"{kind}_s"], values[f"{kind}_peak"] = best[(name, kind)], memory[(name, kind)].peak_bytes
        values["fwdbwd_rss"] = memory[(name, "fwdbwd")].rss_bytes
        rows.append(_row(shape, vocab, problem.num_tokens, name, **values))
    del jobs

    progress(f"{shape.name}: float64 reference, loss epilogue")
    _add_errors(rows, problem, cfg, paths, skipped)
    _add_loss_errors(rows, shape, vocab, cfg, paths, loss_fn)
    lp = torch.randn(problem.target.shape).clamp(max=-0.01)  # the loss epilogue alone, on given log-probs
    epilogue_path = LogprobPath("loss", "the loss epilogue", lambda h, w_, t: h)
    epilogue = measure(_fwd_bwd(epilogue_path, _with_hidden(problem, lp), loss_fn), cfg.repeats)
    rows.append(_row(shape, vocab, problem.num_tokens, "loss", fwdbwd_s=epilogue.seconds,
                     fwdbwd_peak=epilogue.peak_bytes))
    return rows


def _with_hidden(problem: HeadProblem, hidden: torch.Tensor) -> HeadProblem:
    return HeadProblem(hidden, problem.weight, problem.target, problem.data, problem.global_valid_seqs,
                       problem.global_valid_toks)


def _add_errors(rows: list[dict], problem: HeadProblem, cfg: BenchConfig, paths: dict, skipped: dict) -> None:
    n = cfg.ref_tokens
    xs, ts, w = problem.hidden.reshape(-1, problem.hidden.shape[-1])[:n], problem.target.reshape(-1)[:n], problem.weight
    ref_lp, ref_grad = reference_logprobs_and_grad(xs, w, ts)
    for r in rows:
        if r["path"] in paths:
            r["lp_err"], r["grad_err"] = path_errors(paths[r["path"]].fn, xs, w, ts, ref_lp, ref_grad)
        elif r["path"] == "liger" and not skipped.get("liger"):
            r["grad_err"] = max_rel_err(liger_mean_logprob_grad(xs[None], w, ts[None], ref_lp[None]), ref_grad)
        elif r["path"] == "matmul":
            r["lp_err"] = max_abs_err(torch.log_softmax(xs @ w.t(), -1).gather(-1, ts[:, None])[:, 0], ref_lp)


def _add_loss_errors(rows: list[dict], shape: ModelShape, vocab: int, cfg: BenchConfig, paths: dict, loss_fn) -> None:
    """``loss_grad_err``: max relative error of the benchmark loss's ``d loss / d hidden`` against the naive path in
    float64, on a ``ref_tokens``-token problem of the same shape (the single pass's gradients come from its forward,
    so the log-prob gradient of ``grad_err`` does not cover them)."""
    small = make_problem(cfg.batch, cfg.ref_tokens // cfg.batch + 1, shape.hidden, vocab, seed=2)

    def hidden_grad(path: LogprobPath, dtype: torch.dtype) -> torch.Tensor:
        h = small.hidden.detach().to(dtype).requires_grad_(True)
        _path_loss(path, small, loss_fn, h, small.weight.detach().to(dtype)).backward()
        return h.grad

    ref = hidden_grad(paths["naive"], torch.float64)
    for r in rows:
        if r["path"] in paths:
            r["loss_grad_err"] = max_rel_err(hidden_grad(paths[r["path"]], torch.float32), ref)


def memory_sweep(cfg: BenchConfig, progress: Progress, skipped: dict) -> list[dict]:
    """Peak tracked bytes of forward+backward per path and token count at ``cfg.memory_shape`` (one run each)."""
    from nemo_is_plugin import build_loss_fn

    hidden, vocab = cfg.memory_shape
    loss_fn = build_loss_fn(BENCH_LOSS_CONFIG)
    paths = {p.name: p for p in logprob_paths(cfg.chunk_size)}
    points = []
    for tokens in cfg.memory_tokens:
        problem = make_problem(cfg.batch, tokens // cfg.batch + 1, hidden, vocab, seed=1)
        for name in cfg.paths:
            progress(f"memory sweep: {name} at {tokens} tokens")
            if name == "liger" and skipped.get("liger"):
                continue
            run = _liger_fwd_bwd(problem) if name == "liger" else _fwd_bwd(paths[name], problem, loss_fn)
            points.append(_memory_point(name, run, problem))
    return points


def _memory_point(name: str, run: Callable[[], None], problem: HeadProblem) -> dict:
    """One memory-tracked forward+backward of ``run`` on ``problem``, as a sweep / direct-measurement point."""
    m = memory_only(run)
    hidden, vocab = problem.weight.shape[1], problem.weight.shape[0]
    return dict(path=name, tokens=problem.num_tokens, hidden=hidden, vocab=vocab, peak_bytes=m.peak_bytes,
                rss_bytes=m.rss_bytes, seconds=m.seconds)


def direct_memory(cfg: BenchConfig, progress: Progress) -> list[dict]:
    """Peak tracked bytes of forward+backward at ``cfg.extrapolate_tokens`` itself, for ``direct_memory_paths``
    (the memory target is checked on these measurements; the sweep's extrapolation is the cross-check)."""
    from nemo_is_plugin import build_loss_fn

    if not cfg.memory_tokens:
        return []
    hidden, vocab = cfg.memory_shape
    loss_fn = build_loss_fn(BENCH_LOSS_CONFIG)
    paths = {p.name: p for p in logprob_paths(cfg.chunk_size)}
    problem = make_problem(cfg.batch, cfg.extrapolate_tokens // cfg.batch + 1, hidden, vocab, seed=1)
    points = []
    for name in [p for p in cfg.direct_memory_paths if p in cfg.paths and p in paths]:
        progress(f"memory at {cfg.extrapolate_tokens} tokens: {name}")
        points.append(_memory_point(name, _fwd_bwd(paths[name], problem, loss_fn), problem))
    return points


def machine_info(cfg: BenchConfig) -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as fh:
            cpu = next((line.split(":", 1)[1].strip() for line in fh if line.startswith("model name")), cpu)
    except OSError:
        pass
    return dict(cpu=cpu, torch=torch.__version__, threads=cfg.threads, python=platform.python_version(),
                date=datetime.date.today().isoformat())


def run_benchmark(cfg: BenchConfig, progress: Optional[Progress] = None) -> dict:
    """Everything ``nemo-is bench`` reports, as a JSON-able dict: config, machine, rows, memory sweep, skipped."""
    progress = progress or (lambda _label: None)
    torch.set_num_threads(cfg.threads)
    skipped = {}
    if "liger" in cfg.paths and (reason := liger_unavailable_reason()):
        skipped["liger"] = reason
    rows = [r for shape in cfg.shapes for r in bench_shape(shape, cfg, progress, skipped)]
    sweep = memory_sweep(cfg, progress, skipped)
    direct = direct_memory(cfg, progress)
    config = dict(tokens=cfg.tokens, batch=cfg.batch, tp=cfg.tp, chunk_size=cfg.chunk_size, repeats=cfg.repeats,
                  paths=list(cfg.paths), ref_tokens=cfg.ref_tokens, memory_tokens=list(cfg.memory_tokens),
                  memory_shape=list(cfg.memory_shape), extrapolate_tokens=cfg.extrapolate_tokens,
                  direct_memory_paths=list(cfg.direct_memory_paths),
                  shapes=[dict(name=s.name, hidden=s.hidden, vocab=s.vocab) for s in cfg.shapes],
                  loss=BENCH_LOSS_CONFIG)
    return dict(config=config, machine=machine_info(cfg), rows=rows, memory_sweep=sweep, memory_direct=direct,
                skipped=skipped)


__all__ = ["BENCH_LOSS_CONFIG", "bench_shape", "count_steps", "direct_memory", "memory_sweep", "run_benchmark"]
