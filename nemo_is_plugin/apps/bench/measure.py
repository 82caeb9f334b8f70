"""Error measurements against a float64 reference on a few tokens; no knowledge of which path is measured.

The reference is computed vocab block by vocab block (a float64 copy of a whole 7168 x 129280 head would be 7.4 GB).
Timing and memory are device-specific and live in :mod:`nemo_is_plugin.apps.bench.device`; the fp32 reference of the
whole problem (loss, dX, dW) in :mod:`nemo_is_plugin.apps.bench.reference`.
"""

from __future__ import annotations

import torch

from nemo_is_plugin.apps.bench.problem import leaf_grad

REFERENCE_VOCAB_BLOCK = 8192


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
    return max_abs_err(lp.detach(), ref_lp), max_rel_err(leaf_grad(h), ref_grad)


__all__ = ["REFERENCE_VOCAB_BLOCK", "max_abs_err", "max_rel_err", "path_errors", "reference_logprobs_and_grad"]
