"""The torch-against-Triton comparisons the fused-linear (test_fused_linear_triton.py) and the head
(test_head_logprobs_triton.py) Triton tests share: vocab blocks small enough that a tiny row spans several, a GPU run
that puts the default blocks back afterwards, and ``fused_linear_pg_loss`` on both backends in one and two passes.

Nothing here imports Triton: the test modules skip without it, and their checks run in a child process under
Triton's interpreter (tests/kernels/_interpreter.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch


def small_blocks() -> None:
    from nemo_is_plugin.kernels import triton_logprob as tk

    tk.BLOCKS.partials_block_v = tk.BLOCKS.grad_block_v = 16  # rows of 48 columns span 3 blocks


def run_keeping_blocks(check: Callable[..., None], **kwargs: Any) -> None:
    """``check(**kwargs)`` (which sets :func:`small_blocks`), then the block sizes it found, for the tests after it."""
    from nemo_is_plugin.kernels import triton_logprob as tk

    saved = (tk.BLOCKS.partials_block_v, tk.BLOCKS.grad_block_v)
    try:
        check(**kwargs)
    finally:
        tk.BLOCKS.partials_block_v, tk.BLOCKS.grad_block_v = saved


def assert_pg_loss_backends_agree(
    p: Any, config: dict, device: str, dtype: torch.dtype, tol: float, metric_atol: float
):
    """``fused_linear_pg_loss`` of problem ``p`` on the triton backend, single pass and forced two pass, equals the
    torch backend's: the loss (``tol`` relative), the metrics (``tol`` relative, ``metric_atol`` absolute) and both
    gradients (``10 * tol`` of the largest entry)."""
    from nemo_is_plugin import build_loss_fn
    from nemo_is_plugin.distributed.entry_points.fused_linear_loss import fused_linear_pg_loss

    small_blocks()
    data = {key: t.to(device) for key, t in p.data.items()}
    for single in (True, False):
        out = {}
        for backend in ("torch", "triton"):
            h = p.hidden.to(device, dtype).clone().requires_grad_(True)
            w = p.weight.to(device, dtype).clone().requires_grad_(True)
            loss, metrics = fused_linear_pg_loss(
                build_loss_fn(config),
                h,
                w,
                p.target.to(device),
                data,
                p.global_valid_seqs,
                p.global_valid_toks,
                chunk_size=5,
                temperature=1.3,
                single_pass=single,
                backend=backend,
            )
            loss.backward()
            out[backend] = (loss.detach().double().cpu(), metrics, h.grad.double().cpu(), w.grad.double().cpu())
        (l0, m0, dx0, dw0), (l1, m1, dx1, dw1) = out["torch"], out["triton"]
        assert abs(l1 - l0).item() <= tol * abs(l0).item() + 1e-7
        assert m0.keys() == m1.keys() and all(m1[k] == pytest.approx(m0[k], rel=tol, abs=metric_atol) for k in m0)
        for a, b in ((dx1, dx0), (dw1, dw0)):
            assert ((a - b).abs().max() / b.abs().max()).item() < tol * 10
