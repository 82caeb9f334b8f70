"""The callables the benchmark times: the bare GEMMs and every path's forward / forward+backward on one problem.

A job takes no arguments. A forward+backward job returns ``(loss, d loss/d hidden, d loss/d weight)`` of its run so
that the memory-tracked call can be checked against the reference; timed calls drop the result.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from nemo_is_plugin.apps.bench.paths import LogprobPath
from nemo_is_plugin.apps.bench.problem import HeadProblem

# The loss every path's log-probs go through: GRPO-style clipped PG with token-level TIS and the default k3 KL.
BENCH_LOSS_CONFIG = dict(
    use_importance_sampling_correction=True,
    truncated_importance_sampling_type="tis",
    truncated_importance_sampling_ratio=2.0,
)

Job = Callable[[], object]
FwdBwdResult = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]


def bench_loss_fn():
    """The configured plugin loss of :data:`BENCH_LOSS_CONFIG` (also the model step's)."""
    from nemo_is_plugin import build_loss_fn

    return build_loss_fn(BENCH_LOSS_CONFIG)


def path_loss(path: LogprobPath, problem: HeadProblem, loss_fn, h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The benchmark loss of ``path`` on ``problem`` with ``h`` / ``w`` standing in for its hidden states and head."""
    if path.loss is not None:
        return path.loss(loss_fn, problem, h, w)
    if path.fn is None:
        raise ValueError(f"path {path.name!r} has neither a log-prob function nor a loss of its own")
    loss, _ = loss_fn(
        next_token_logprobs=path.fn(h, w, problem.target),
        data=problem.data,
        global_valid_seqs=problem.global_valid_seqs,
        global_valid_toks=problem.global_valid_toks,
    )
    return loss


def fwd_bwd_job(path: LogprobPath, problem: HeadProblem, loss_fn) -> Callable[[], FwdBwdResult]:
    """Forward, loss, ``backward()`` into fresh leaves of the hidden states and the head."""

    def run() -> FwdBwdResult:
        h = problem.hidden.detach().requires_grad_(True)
        w = problem.weight.detach().requires_grad_(True)
        loss = path_loss(path, problem, loss_fn, h, w)
        loss.backward()
        return loss.detach(), h.grad, w.grad

    return run


def forward_job(path: LogprobPath, problem: HeadProblem) -> Job:
    """Log-probs under ``no_grad`` (the old-policy / reference pass)."""
    fn = path.fn
    if fn is None:
        raise ValueError(f"path {path.name!r} has no log-prob function to time")

    def run() -> None:
        with torch.no_grad():
            fn(problem.hidden, problem.weight, problem.target)

    return run


def gemm_operands(problem: HeadProblem) -> tuple[torch.Tensor, torch.Tensor]:
    """``X [N, H]`` and ``W [V, H]`` as the bare GEMM takes them: the input dtype, upcast to fp32 on CPU (a bf16 CPU
    GEMM is ~100x slower, and every path upcasts there too)."""
    x, w = problem.hidden.reshape(-1, problem.hidden.shape[-1]), problem.weight
    if x.device.type == "cpu" and x.dtype in (torch.bfloat16, torch.float16):
        x, w = x.float(), w.float()
    return x, w


def matmul_jobs(problem: HeadProblem) -> dict[tuple[str, str], Job]:
    """The limit: one forward GEMM ``Z = X W^T``; and the 3 GEMMs of a forward+backward that keeps the logits
    (``Z``, ``dX = dZ W``, ``dW = dZ^T X``, here with ``Z`` itself as the upstream gradient: same shapes, no extra
    ``[N, V]`` input)."""
    x, w = gemm_operands(problem)

    def forward() -> None:
        torch.mm(x, w.t())

    def forward_backward() -> None:
        z = torch.mm(x, w.t())
        torch.mm(z, w)
        torch.mm(z.t(), x)

    return {("matmul", "fwd"): forward, ("matmul", "fwdbwd"): forward_backward}


def path_jobs(path: LogprobPath, problem: HeadProblem, loss_fn) -> dict[tuple[str, str], Job]:
    """``{(name, "fwd"): ..., (name, "fwdbwd"): ...}`` of one available path (the forward only if it times one)."""
    jobs: dict[tuple[str, str], Job] = {}
    if path.times_forward and path.fn is not None:
        jobs[(path.name, "fwd")] = forward_job(path, problem)
    if path.fwdbwd_unavailable is None:
        jobs[(path.name, "fwdbwd")] = fwd_bwd_job(path, problem, loss_fn)
    return jobs


__all__ = [
    "BENCH_LOSS_CONFIG",
    "FwdBwdResult",
    "Job",
    "bench_loss_fn",
    "fwd_bwd_job",
    "forward_job",
    "gemm_operands",
    "matmul_jobs",
    "path_jobs",
    "path_loss",
]
