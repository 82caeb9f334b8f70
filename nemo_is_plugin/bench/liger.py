"""Liger-Kernel's chunked GRPO loss (``LigerFusedLinearGRPOLoss``) as a benchmark baseline, where it installs.

Liger fuses LM head, selective log-prob (online lse over 2048-token x 4096-vocab tiles) and its own GRPO loss, and
computes the gradients inside its forward. So only forward+backward is comparable; its "forward" already contains
the backward and is not reported. Configured as close to our default measurement as its options allow: loss_type
"dapo" (token-mean), token-level ratio clipped at 0.2, k3 KL with beta=0.01 to given reference log-probs, the token IS
weight exp(prev - gen) passed as ``vllm_is_ratio``. ``compiled=False``: its torch.compile of the loss math takes ~25 s
per shape on this CPU and does not touch the GEMMs, which decide the time here.

Install: ``pip install 'nemo-is-plugin[liger]'`` (liger-kernel >= 0.6; pulls triton, whose GPU kernels are unused).
"""

from __future__ import annotations

import importlib
from typing import Optional

import torch

from nemo_is_plugin.bench.problem import HeadProblem


def liger_unavailable_reason() -> Optional[str]:
    """None when the Liger GRPO loss imports, else why not (the benchmark prints it and skips the row)."""
    try:
        importlib.import_module("liger_kernel.chunked_loss")
    except Exception as exc:  # ImportError, or triton failing to initialise
        return f"liger-kernel not importable ({type(exc).__name__}: {exc})"
    return None


def liger_loss(beta: float = 0.01):
    from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

    return LigerFusedLinearGRPOLoss(
        beta=beta, compiled=False, use_ref_model=beta != 0, chunk_size=1, loss_type="dapo",
        epsilon_low=0.2, epsilon_high=0.2,
    )


def liger_fwd_bwd(problem: HeadProblem, hidden: torch.Tensor, weight: torch.Tensor, loss_module) -> torch.Tensor:
    """Liger's loss on the problem's batch; backward included (returns the loss after ``backward()``)."""
    d = problem.data
    mask = d["token_mask"][:, 1:] * d["sample_mask"].unsqueeze(1)
    prev, gen = d["prev_logprobs"][:, 1:], d["generation_logprobs"][:, 1:]
    loss, _ = loss_module(
        hidden, weight, problem.target, mask, d["advantages"][:, 1],
        ref_per_token_logps=d["reference_policy_logprobs"][:, 1:],
        old_per_token_logps=prev,
        vllm_is_ratio=(prev - gen).exp(),
    )
    loss.backward()
    return loss.detach()


def liger_mean_logprob_grad(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                            ref_logprobs: torch.Tensor) -> torch.Tensor:
    """d/d hidden of Liger's loss at ratio 1, advantage 1, no KL: ``-mean_t r_t`` with r_t = exp(lp_t - ref_t).

    With ``ref_logprobs`` the exact log-probs, r_t = 1 up to Liger's own error, so this equals the gradient of
    ``-mean_t lp_t``: the quantity the other paths' gradient error is measured on. ``hidden [1, n, H]``.
    """
    h = hidden.detach().clone().requires_grad_(True)
    n = target.numel()
    loss, _ = liger_loss(beta=0.0)(
        h, weight.detach(), target, torch.ones(1, n), torch.ones(1), old_per_token_logps=ref_logprobs.float()
    )
    loss.backward()
    return h.grad


__all__ = ["liger_fwd_bwd", "liger_loss", "liger_mean_logprob_grad", "liger_unavailable_reason"]
