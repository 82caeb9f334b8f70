"""What score centering's head costs: ``nemo-is bench --score-centering-head``.

Score centering (arXiv 2609.20807) needs the trainer's log-probs of the sampler's top-k ids at every position, from
the label's softmax pass (:mod:`~nemo_is_plugin.kernels.head_ids`). Per model shape and LM-head path this times a
forward + backward of the head with ``k`` head ids per token against the same head without them (``k = 0``), every
job once per round, rounds interleaved (best round on CPU, median on CUDA: :class:`~nemo_is_plugin.apps.bench.device.
BenchDevice`), and reports each time as a ratio to the ``k = 0`` time of its path in the same run. On CUDA the clock
is CUDA events; on a CPU it is the process's CPU time (``time.process_time``), not the wall clock: on a shared machine
the other processes' load stretches wall times by tens of percent from one call to the next, CPU time far less, and
the head's extra work is a few percent. Paths:

- ``from_logits``: ``logits = hidden @ W^T`` (autograd), then :func:`vocab_parallel_logprobs` (the LOGIT loss's head);
- ``fused_2pass``: :func:`fused_linear_logprobs` (forward, recomputing backward: 4 GEMMs);
- ``fused_linear``: the fused single pass (3 GEMMs; the chunk's gradient from a per-token linear loss, so that only
  the head is measured).

The loss on the log-probs is ``sum c_y log p_y + sum_valid c_v log p_v`` (constants ``c``): what score centering's
term adds to the head's work is its k gathers, the TP all-reduce's k extra rows (none here: one rank's work), the
``[N, k]`` vectors and the backward's k scatter-adds; the GEMMs are unchanged. Head ids:
random ids, the label among them for most tokens, a few ``-1`` padding slots.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from nemo_is_plugin.apps.bench.device import BenchDevice, clocked
from nemo_is_plugin.apps.bench.shapes import MODEL_SHAPES, QUICK_SHAPES, ModelShape
from nemo_is_plugin.distributed.entry_points.fused_linear_loss import _SinglePassFusedLoss, token_grad_step
from nemo_is_plugin.distributed.head.fused_linear import HeadOptions, check_lm_head_call, fused_linear_logprobs
from nemo_is_plugin.distributed.head.vocab_parallel import vocab_parallel_logprobs

HEAD_PATHS = ("from_logits", "fused_2pass", "fused_linear")
HEAD_KS = (0, 32, 128)
TARGET_K, TARGET_RATIO = 32, 1.05  # the target: the head with k = 32 within 5% of the head without it


@dataclass
class HeadCostConfig:
    """One ``--score-centering-head`` run: shapes, tokens, ks (0 = the baseline, always measured), paths, rounds."""

    shapes: tuple[ModelShape, ...] = MODEL_SHAPES[:1]
    tokens: int = 256
    ks: tuple[int, ...] = HEAD_KS
    paths: tuple[str, ...] = HEAD_PATHS
    repeats: int = 3
    warmup: int = 1
    chunk_size: int | None = None
    device: str = "cpu"
    dtype: str | None = None
    threads: int = 1
    quick_run: bool = False
    seed: int = field(default=0)

    def __post_init__(self) -> None:
        if unknown := [p for p in self.paths if p not in HEAD_PATHS]:
            raise ValueError(f"unknown head path(s) {unknown}; choose from {list(HEAD_PATHS)}")
        if any(k < 0 for k in self.ks):
            raise ValueError(f"head sizes k must be >= 0, got {list(self.ks)}")
        if 0 not in self.ks:
            self.ks = (0, *self.ks)
        if self.tokens < 1 or self.repeats < 1:
            raise ValueError(f"tokens and repeats must be >= 1, got {self.tokens}, {self.repeats}")

    @classmethod
    def for_device(cls, device: str = "cpu", quick: bool = False, **overrides) -> HeadCostConfig:
        """CPU: one shape (Qwen3-30B-A3B), 256 tokens, fp32; CUDA: bf16, 16,384 tokens, median of 5 after 2 warm-ups;
        quick: tiny shapes (smoke runs, numbers not meaningful)."""
        base: dict = {}
        if device.startswith("cuda"):
            base.update(tokens=16384, repeats=5, warmup=2)
        if quick:
            base.update(shapes=QUICK_SHAPES[:1], tokens=64, chunk_size=16, repeats=1, quick_run=True)
        base.update({k: v for k, v in overrides.items() if v is not None})
        return cls(device=device, **base)


def head_ids_like_a_sampler(
    target: torch.Tensor, vocab: int, k: int, generator: torch.Generator, pad_every: int = 7
) -> torch.Tensor:
    """``[N, k]`` random ids, the label in slot 0 of most rows, ``-1`` in the last slot of every ``pad_every``-th
    row (a head the sampler could not fill). A repeated id costs what a distinct one does."""
    n = target.shape[0]
    ids = torch.randint(0, vocab, (n, k), generator=generator)
    has_label = torch.rand(n, generator=generator) < 0.9
    ids[:, 0] = torch.where(has_label, target.cpu(), ids[:, 0])
    ids[::pad_every, -1] = -1
    return ids.to(target.device)


def _jobs(bench: BenchDevice, shape: ModelShape, cfg: HeadCostConfig) -> dict[tuple[str, int], Callable[[], None]]:
    g = torch.Generator().manual_seed(cfg.seed)
    n = cfg.tokens
    hidden = torch.randn(n, shape.hidden, generator=g).to(bench.device, bench.dtype)
    weight = (torch.randn(shape.vocab, shape.hidden, generator=g) * (2.0 / shape.hidden**0.5)).to(
        bench.device, bench.dtype
    )
    target = torch.randint(0, shape.vocab, (n,), generator=g).to(bench.device)
    c_label = torch.randn(n, generator=g).to(bench.device)
    heads = {k: head_ids_like_a_sampler(target, shape.vocab, k, g) for k in cfg.ks if k}
    c_heads = {k: torch.randn(n, k, generator=g).to(bench.device) for k in cfg.ks if k}
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    chunk = check_lm_head_call(hidden, weight, target, 1.0, cfg.chunk_size)

    def loss_of(lp, head, k):
        loss = (lp * c_label).sum()
        if k:
            loss = loss + torch.where(torch.isfinite(head), head * c_heads[k], 0.0).sum()
        return loss

    def make(path: str, k: int) -> Callable[[], None]:
        ids = heads.get(k)

        def run() -> None:
            h.grad = w.grad = None
            if path == "fused_linear":
                c_head = c_heads.get(k)

                def token_grad(sl, c, *head):
                    return (c_label[sl], c_head[sl]) if head and c_head is not None else c_label[sl]

                loss = _SinglePassFusedLoss.apply(
                    h,
                    w,
                    target,
                    ids,
                    token_grad_step(token_grad),
                    lambda lp, head: lp.sum().detach(),
                    HeadOptions(None, chunk, 1.0),
                )
                loss.backward()
                return
            if path == "fused_2pass":
                out = fused_linear_logprobs(h, w, target, chunk_size=chunk, head_ids=ids)
            else:
                out = vocab_parallel_logprobs(h @ w.t(), target, chunk_size=cfg.chunk_size, head_ids=ids)
            lp, head = out if ids is not None else (out, None)
            loss_of(lp, head, k).backward()

        return run

    return {(p, k): make(p, k) for p in cfg.paths for k in cfg.ks}


def cpu_seconds(fn: Callable[[], object]) -> float:
    """CPU seconds of this process during one call of ``fn`` (all its threads), the collector paused as in timeit."""
    return clocked(fn, time.process_time)


def run_head_cost(cfg: HeadCostConfig, progress: Callable[[str], None] = lambda _: None) -> dict:
    """Time every (shape, path, k) and return the rows (seconds and ratio to k = 0 of the same path) with the
    machine's description."""
    bench = BenchDevice.resolve(cfg.device, cfg.dtype)
    torch.set_num_threads(cfg.threads)
    clock = bench.time_call if bench.is_cuda else cpu_seconds
    rows = []
    for shape in cfg.shapes:
        jobs = _jobs(bench, shape, cfg)
        for name, job in jobs.items():
            progress(f"{shape.name}: warm-up {name[0]} k={name[1]}")
            for _ in range(cfg.warmup):
                job()
            bench.synchronize()
        seconds: dict[tuple[str, int], list[float]] = {name: [] for name in jobs}
        for r in range(cfg.repeats):
            progress(f"{shape.name}: round {r + 1}/{cfg.repeats}")
            for name, job in jobs.items():
                seconds[name].append(clock(job))
        for (path, k), times in seconds.items():
            t = bench.summarise(times)
            base = bench.summarise(seconds[(path, 0)])
            rows.append(
                dict(
                    model=shape.name, hidden=shape.hidden, vocab=shape.vocab, path=path, k=k, seconds=t, ratio=t / base
                )
            )
        del jobs
        bench.release_cached()
    config = dict(
        tokens=cfg.tokens,
        ks=list(cfg.ks),
        paths=list(cfg.paths),
        repeats=cfg.repeats,
        chunk_size=cfg.chunk_size,
        threads=cfg.threads,
        quick=cfg.quick_run,
        clock="CUDA events" if bench.is_cuda else "process CPU time",
        **bench.recorded(),
    )
    return dict(config=config, machine=bench.describe(), rows=rows)


def count_steps(cfg: HeadCostConfig) -> int:
    """``progress`` calls of :func:`run_head_cost` (a progress bar's total)."""
    return len(cfg.shapes) * (len(cfg.paths) * len(cfg.ks) + cfg.repeats)


def head_cost_targets(results: dict) -> list[dict]:
    """The target per (model, path): the head with k = 32 within 5% of the head without it, in this run (none for a
    ``--quick`` run: its tiny shapes say nothing about the cost)."""
    if results["config"].get("quick"):
        return []
    return [
        dict(
            target=f"{r['model']} {r['path']}: head with k = {TARGET_K} / without (<= {TARGET_RATIO})",
            value=r["ratio"],
            ok=r["ratio"] <= TARGET_RATIO,
        )
        for r in results["rows"]
        if r["k"] == TARGET_K
    ]


def head_cost_table(results: dict):
    """A rich table: one row per (model, path), the time without the head and the ratio at each k."""
    from rich.table import Table

    cfg = results["config"]
    ks = [k for k in cfg["ks"] if k]
    table = Table(
        title=f"score-centering head: forward + backward, {cfg['tokens']} tokens, {cfg['dtype']} on "
        f"{results['machine']['device_name']} ({cfg['statistic']} of {cfg['repeats']} rounds, "
        f"{cfg.get('clock', 'wall clock')})"
    )
    for col in ("model", "path", "k = 0 (s)", *(f"k = {k} / k = 0" for k in ks)):
        table.add_column(col)
    by = {(r["model"], r["path"], r["k"]): r for r in results["rows"]}
    for model, path in dict.fromkeys((r["model"], r["path"]) for r in results["rows"]):
        cells = [f"{by[(model, path, k)]['ratio']:.3f}" for k in ks]
        table.add_row(model, path, f"{by[(model, path, 0)]['seconds']:.3g}", *cells)
    return table


__all__ = [
    "HEAD_KS",
    "HEAD_PATHS",
    "HeadCostConfig",
    "count_steps",
    "head_cost_table",
    "head_cost_targets",
    "head_ids_like_a_sampler",
    "run_head_cost",
]
