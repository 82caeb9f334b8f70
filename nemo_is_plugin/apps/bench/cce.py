"""Apple's cut-cross-entropy (``cut-cross-entropy``) as a benchmark baseline, where it is installed and on CUDA.

CCE computes the per-token cross-entropy straight from hidden states and the classifier without writing logits to
memory (tiled GEMM with an on-chip log-sum-exp; the backward recomputes the logits per block). With
``reduction="none"`` it returns the per-token NLL, i.e. minus the log-prob of the target, so its row feeds the same
plugin loss as every other path (loss and dX errors are comparable). ``impl="cce"`` with ``filter_eps=None``: no
gradient filtering, the variant whose gradients match the exact softmax (its default ``filter_eps="high"`` skips
blocks whose softmax is below bf16 precision). The released package (25.1.1) has no ``impl="cce_exact"`` (the first
H100 run failed on it with NotImplementedError); ``filter_eps=None`` turns the filtering off in the releases that
take the keyword. Its kernels are Triton GPU kernels; the CPU fallback (``impl="torch_compile"``) is a compiled
full-logits cross-entropy, not the algorithm, so the row is CUDA-only.

Install: ``pip install 'nemo-is-plugin[cce]'``. Imported only when the row runs.
"""

from __future__ import annotations

import importlib
import importlib.util

import torch

from nemo_is_plugin.apps.bench.paths import LogprobPath

CCE_IMPL = "cce"
CCE_FILTER_EPS = None  # no gradient filtering: exact softmax gradients


def cce_unavailable_reason(device: torch.device) -> str | None:
    """None when the CCE row can run on ``device``, else why not."""
    if importlib.util.find_spec("cut_cross_entropy") is None:
        return "not installed (pip install 'nemo-is-plugin[cce]')"
    if device.type != "cuda":
        return f"its Triton kernels need a CUDA device (device here: {device.type})"
    try:
        importlib.import_module("cut_cross_entropy")
    except Exception as exc:  # installed, but e.g. triton fails to initialise
        return f"cut-cross-entropy not importable ({type(exc).__name__}: {exc})"
    return None


def cce_logprobs(
    hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, impl: str = CCE_IMPL
) -> torch.Tensor:
    """fp32 ``[...]`` log-probs of ``target`` from ``hidden [..., H]`` and ``weight [V, H]`` through CCE."""
    from cut_cross_entropy import linear_cross_entropy

    flat = hidden.reshape(-1, hidden.shape[-1])
    nll = linear_cross_entropy(flat, weight, target.reshape(-1), reduction="none", filter_eps=CCE_FILTER_EPS, impl=impl)
    return -nll.float().view(target.shape)


def cce_path(device: torch.device) -> LogprobPath:
    return LogprobPath(
        "cce",
        f"cut-cross-entropy linear_cross_entropy (impl={CCE_IMPL!r}, filter_eps=None) log-probs -> plugin loss",
        cce_logprobs,
        unavailable=cce_unavailable_reason(device),
        # seen on an H100: "AssertionError: Backwards requires embeddings to be bf16 or fp16"
        fp32_check_unavailable="its backward takes bf16 / fp16 embeddings only",
    )


__all__ = ["CCE_IMPL", "cce_logprobs", "cce_path", "cce_unavailable_reason"]
