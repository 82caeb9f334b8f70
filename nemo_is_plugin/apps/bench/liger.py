"""Liger-Kernel's chunked GRPO loss (``LigerFusedLinearGRPOLoss``) as a benchmark baseline, where it installs.

Liger fuses LM head, selective log-prob (online lse over 2048-token x 4096-vocab tiles) and its own GRPO loss, and
computes the gradients inside its forward. So only forward+backward is comparable; its "forward" already contains
the backward and is not reported. Configured as close to our default measurement as its options allow: loss_type
"dapo" (token-mean), token-level ratio clipped at 0.2, k3 KL with beta=0.01 to given reference log-probs, the token IS
weight exp(prev - gen) passed as ``vllm_is_ratio``. ``compiled`` only on CUDA (Liger's recommended setting there): on
CPU its torch.compile of the loss math takes ~25 s per shape and does not touch the GEMMs, which decide the time.

Install: ``pip install 'nemo-is-plugin[liger]'`` (liger-kernel >= 0.6; pulls triton, whose GPU kernels are unused).
"""

from __future__ import annotations

import importlib
import importlib.util

import torch

from nemo_is_plugin.apps.bench.paths import LogprobPath
from nemo_is_plugin.apps.bench.problem import HeadProblem, leaf_grad


def liger_unavailable_reason() -> str | None:
    """None when the Liger GRPO loss imports, else why not (the benchmark prints it and skips the row)."""
    if importlib.util.find_spec("liger_kernel") is None:
        return "not installed (pip install 'nemo-is-plugin[liger]')"
    try:
        importlib.import_module("liger_kernel.chunked_loss")
    except Exception as exc:  # ImportError, or triton failing to initialise
        return f"liger-kernel not importable ({type(exc).__name__}: {exc})"
    return None


def liger_loss(beta: float = 0.01, compiled: bool = False):
    from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

    return LigerFusedLinearGRPOLoss(
        beta=beta,
        compiled=compiled,
        use_ref_model=beta != 0,
        chunk_size=1,
        loss_type="dapo",
        epsilon_low=0.2,
        epsilon_high=0.2,
    )


def liger_path(device: torch.device) -> LogprobPath:
    """The ``liger`` row: its own loss from hidden states (gradients inside its forward); no separate forward row."""
    modules: dict = {}  # built on first use, so that an uninstalled Liger is only ever a reason string

    def loss(_loss_fn, problem: HeadProblem, h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if "grpo" not in modules:
            modules["grpo"] = liger_loss(compiled=device.type == "cuda")
        return liger_loss_value(problem, h, w, modules["grpo"])

    return LogprobPath(
        "liger",
        "LigerFusedLinearGRPOLoss: its own GRPO loss, gradients inside its forward",
        None,
        loss=loss,
        times_forward=False,
        own_loss=True,
        unavailable=liger_unavailable_reason(),
    )


def liger_loss_value(problem: HeadProblem, hidden: torch.Tensor, weight: torch.Tensor, loss_module) -> torch.Tensor:
    """Liger's loss on the problem's batch (differentiable; ``backward()`` is the caller's)."""
    d = problem.data
    mask = d["token_mask"][:, 1:] * d["sample_mask"].unsqueeze(1)
    prev, gen = d["prev_logprobs"][:, 1:], d["generation_logprobs"][:, 1:]
    loss, _ = loss_module(
        hidden,
        weight,
        problem.target,
        mask,
        d["advantages"][:, 1],
        ref_per_token_logps=d["reference_policy_logprobs"][:, 1:],
        old_per_token_logps=prev,
        vllm_is_ratio=(prev - gen).exp(),
    )
    return loss


def liger_mean_logprob_grad(
    hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, ref_logprobs: torch.Tensor
) -> torch.Tensor:
    """d/d hidden of Liger's loss at ratio 1, advantage 1, no KL: ``-mean_t r_t`` with r_t = exp(lp_t - ref_t).

    With ``ref_logprobs`` the exact log-probs, r_t = 1 up to Liger's own error, so this equals the gradient of
    ``-mean_t lp_t``: the quantity the other paths' gradient error is measured on. ``hidden [1, n, H]``.
    """
    h = hidden.detach().clone().requires_grad_(True)
    n = target.numel()
    ones = torch.ones(1, n, device=hidden.device)
    loss, _ = liger_loss(beta=0.0)(
        h, weight.detach(), target, ones, ones[:, 0], old_per_token_logps=ref_logprobs.float()
    )
    loss.backward()
    return leaf_grad(h)


__all__ = ["liger_loss", "liger_loss_value", "liger_mean_logprob_grad", "liger_path", "liger_unavailable_reason"]
