"""Timing, memory and error measurements of one callable; no knowledge of which path it is.

Timing: ``time.perf_counter`` around the call, best of ``repeats`` (the machine is shared: the minimum is the least
disturbed run). Every measurement is preceded by one memory-tracked run of the same call, which is also the warm-up.
Memory: see :mod:`nemo_is_plugin.bench.memory` (tracked tensor bytes = the reported number; RSS as cross-check).
Errors: against a float64 reference computed vocab block by vocab block (a float64 copy of a whole 7168 x 129280
head would be 7.4 GB).
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from nemo_is_plugin.bench.memory import RssPeak, TensorMemoryTracker

REFERENCE_VOCAB_BLOCK = 8192


@dataclass
class Timed:
    seconds: float
    peak_bytes: int
    rss_bytes: Optional[int]


def measure(fn: Callable[[], object], repeats: int) -> Timed:
    """Run ``fn`` once under memory tracking (warm-up), then ``repeats`` times timed; results of ``fn`` are dropped."""
    first = memory_only(fn)
    return Timed(best_time(fn, repeats), first.peak_bytes, first.rss_bytes)


def best_time(fn: Callable[[], object], repeats: int = 1) -> float:
    """Minimum wall time of ``repeats`` calls of an already warm ``fn``."""
    best = float("inf")
    enabled = gc.isenabled()
    gc.disable()  # like timeit: no collector pause inside a timed call
    try:
        for _ in range(max(1, repeats)):
            start = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - start)
    finally:
        if enabled:
            gc.enable()
    return best


def memory_only(fn: Callable[[], object]) -> Timed:
    """Peak tracked bytes (and RSS) of one run of ``fn``; ``seconds`` is that run's wall time (includes tracking)."""
    gc.collect(1)  # young cyclic garbage (tensors of the previous run); a full collection costs ~0.3 s here
    start = time.perf_counter()
    with RssPeak() as rss, TensorMemoryTracker() as mem:
        fn()
    return Timed(time.perf_counter() - start, mem.peak, rss.delta)


def max_abs_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return (got.double() - want.double()).abs().max().item()


def max_rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want| (a scale-free error for gradients)."""
    return max_abs_err(got, want) / max(want.double().abs().max().item(), 1e-300)


@torch.no_grad()
def reference_logprobs_and_grad(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor):
    """float64 log-probs ``[n]`` of ``target`` and ``d(-mean lp)/d hidden [n, H]``, from ``hidden [n, H]``.

    The gradient is written out: ``-(1/n) (W[y_t] - sum_v p_tv W[v])``; W is upcast one vocab block at a time.
    """
    x, starts = hidden.double(), range(0, weight.shape[0], REFERENCE_VOCAB_BLOCK)
    logits = torch.cat([x @ weight[s : s + REFERENCE_VOCAB_BLOCK].double().t() for s in starts], dim=-1)
    logp = torch.log_softmax(logits, dim=-1)
    lp = logp.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    p = logp.exp_()
    expected_w = torch.zeros_like(x)
    for s in starts:
        expected_w += p[:, s : s + REFERENCE_VOCAB_BLOCK] @ weight[s : s + REFERENCE_VOCAB_BLOCK].double()
    grad = -(weight[target].double() - expected_w) / target.numel()
    return lp, grad


def path_errors(fn, hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, ref_lp, ref_grad):
    """(max |log-prob error|, max relative error of d(-mean lp)/d hidden) of a ``(h, w, t) -> lp`` path."""
    h = hidden.detach().clone().requires_grad_(True)
    lp = fn(h, weight.detach(), target)
    (-lp.mean()).backward()
    return max_abs_err(lp.detach(), ref_lp), max_rel_err(h.grad, ref_grad)


__all__ = [
    "Timed", "best_time", "max_abs_err", "max_rel_err", "measure", "memory_only", "path_errors",
    "reference_logprobs_and_grad",
]
