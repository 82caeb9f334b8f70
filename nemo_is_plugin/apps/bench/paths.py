"""The log-prob paths the benchmark compares, all with one signature: ``(hidden, weight, target) -> logprobs``.

Shapes: ``hidden [..., H]``, ``weight [V, H]`` (one TP rank's shard in the benchmark: the local work, no collective),
``target [...]`` ids; returns fp32 ``[...]``, differentiable w.r.t. ``hidden`` and ``weight``.

- ``naive``: NeMo-RL's default (``DistributedLogprob``): full logits ``[N, V]``, fp32 ``log_softmax`` (saved for
  backward), gather. Also the test reference.
- ``from_logits``: the full logits, then the chunked ``vocab_parallel_logprobs`` (online lse per chunk, saves
  ``lse [N]`` and the logits by reference, recomputing backward): no fp32 softmax, but the ``[N, V]`` logits live.
- the fused variants (``FUSED_VARIANTS``, one line each: name, schedule, keyword arguments of the fused entry
  points): ``fused_linear`` is ``fused_linear_logprobs`` for the forward and ``fused_linear_pg_loss`` for
  forward+backward, which for the benchmark's token-level loss runs the single pass (3 GEMMs, gradients computed
  chunk by chunk in the forward); ``fused_2pass`` forces the two-pass schedule (log-probs, loss, recomputing
  backward: 4 GEMMs), what the sequence-level ratios cost; ``*_triton`` the same on the Triton backend.
- baselines that live in their own modules: Liger's chunked GRPO loss (:mod:`bench.liger`, its own loss) and
  cut-cross-entropy (:mod:`bench.cce`, per-token log-probs into our loss).

``logprob_paths`` is the plugin's own torch paths (also used by the fused-path parity tests);
:func:`nemo_is_plugin.apps.bench.catalog.bench_paths` adds the Triton variants and the baselines, each with
``unavailable`` set when it cannot run here (not installed, needs CUDA, an entry point without the keyword it needs):
the benchmark reports those and never crashes on them.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from nemo_is_plugin.apps.bench.problem import HeadProblem
from nemo_is_plugin.distributed.entry_points.fused_linear_loss import fused_linear_pg_loss
from nemo_is_plugin.distributed.head.fused_linear import fused_linear_logprobs
from nemo_is_plugin.distributed.head.vocab_parallel import vocab_parallel_logprobs

LogprobFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
# (loss_fn, problem, hidden, weight) -> loss: a path that computes the loss itself from hidden states
LossPathFn = Callable[[Any, HeadProblem, torch.Tensor, torch.Tensor], torch.Tensor]


def lm_head_logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``hidden @ weight.T`` in fp32 (CPU GEMMs in bf16 are ~100x slower, so half inputs are upcast first)."""
    if hidden.device.type == "cpu" and hidden.dtype in (torch.bfloat16, torch.float16):
        hidden, weight = hidden.float(), weight.float()
    return hidden @ weight.t()


def naive_logprobs(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Full logits -> fp32 log_softmax -> gather (keeps ``[N, V]`` fp32 alive for the backward)."""
    logp = torch.log_softmax(lm_head_logits(hidden, weight).float(), dim=-1)
    return logp.gather(-1, target.unsqueeze(-1)).squeeze(-1)


@dataclass(frozen=True)
class LogprobPath:
    """``fn`` gives the log-probs (the forward row); the forward+backward row runs ``loss_fn(fn(...))`` unless the path
    has its own ``loss`` entry. ``times_forward=False``: the forward is another path's (not timed twice).
    ``own_loss``: the path computes a different loss (Liger), so no loss / dX error against the reference.
    ``unavailable``: why the path cannot run here (None: it can); ``fwdbwd_unavailable``: why only its
    forward+backward cannot (its forward row still runs); ``fp32_check_unavailable``: why its gradient cannot be taken
    in fp32 for the algorithm check against float64 (``loss_grad_err``; its bf16 errors are still reported)."""

    name: str
    description: str
    fn: LogprobFn | None
    loss: LossPathFn | None = None
    times_forward: bool = True
    own_loss: bool = False
    unavailable: str | None = None
    fwdbwd_unavailable: str | None = None
    fp32_check_unavailable: str | None = None


@dataclass(frozen=True)
class FusedVariant:
    """One fused path: ``single_pass`` as ``fused_linear_pg_loss`` takes it, ``kwargs`` passed to both entry points."""

    name: str
    single_pass: bool | None
    description: str
    kwargs: dict = field(default_factory=dict)


FUSED_VARIANTS = (
    FusedVariant(
        "fused_linear",
        None,
        "hidden states + LM-head shard, chunked; loss in one pass for token-level ratios (fused_linear_loss)",
    ),
    FusedVariant(
        "fused_2pass",
        False,
        "the same, two-pass schedule: log-probs, loss, recomputing backward (sequence-level ratios)",
    ),
    FusedVariant("fused_triton", None, "fused_linear on the Triton backend", {"backend": "triton"}),
    FusedVariant("fused_2pass_triton", False, "fused_2pass on the Triton backend", {"backend": "triton"}),
)
PLUGIN_PATHS = ("naive", "from_logits", "fused_linear", "fused_2pass")


def _accepts(fn: Callable, kwargs: dict) -> list[str]:
    """The keys of ``kwargs`` that ``fn`` has no parameter for."""
    params = inspect.signature(fn).parameters
    return [k for k in kwargs if k not in params]


def _names(keys: list[str]) -> str:
    return ", ".join(f"`{k}`" for k in keys) + (" argument" if len(keys) == 1 else " arguments")


def fused_path(variant: FusedVariant, chunk_size: int | None) -> LogprobPath:
    kw = dict(variant.kwargs) if chunk_size is None else {**variant.kwargs, "chunk_size": chunk_size}
    missing_lp = _accepts(fused_linear_logprobs, kw)
    missing_loss = _accepts(fused_linear_pg_loss, kw)
    unavailable = f"fused_linear_logprobs takes no {_names(missing_lp)} in this version" if missing_lp else None
    fwdbwd_unavailable = None
    if missing_loss and variant.single_pass is not False:
        fwdbwd_unavailable = f"fused_linear_pg_loss takes no {_names(missing_loss)} in this version"

    def logprobs(h: torch.Tensor, w: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return fused_linear_logprobs(h, w, t, **kw)

    def loss(loss_fn, problem: HeadProblem, h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if missing_loss:  # two-pass schedule spelled out: what fused_linear_pg_loss(single_pass=False) runs
            return loss_fn(
                logprobs(h, w, problem.target), problem.data, problem.global_valid_seqs, problem.global_valid_toks
            )[0]
        out, _ = fused_linear_pg_loss(
            loss_fn,
            h,
            w,
            problem.target,
            problem.data,
            problem.global_valid_seqs,
            problem.global_valid_toks,
            single_pass=variant.single_pass,
            **kw,
        )
        return out

    return LogprobPath(
        variant.name,
        variant.description,
        logprobs,
        loss=loss,
        times_forward=variant.single_pass is not False,
        unavailable=unavailable,
        fwdbwd_unavailable=fwdbwd_unavailable,
    )


def logprob_paths(chunk_size: int | None = None) -> list[LogprobPath]:
    """The plugin's torch paths in benchmark order (``PLUGIN_PATHS``); ``chunk_size`` (tokens per chunk) for the
    chunked ones, None = their default."""
    fused = {v.name: v for v in FUSED_VARIANTS}
    return [
        LogprobPath("naive", "full logits + fp32 log_softmax (NeMo-RL DistributedLogprob)", naive_logprobs),
        LogprobPath(
            "from_logits",
            "full logits + chunked online-lse log-prob, recomputing backward (vocab_parallel)",
            lambda h, w, t: vocab_parallel_logprobs(lm_head_logits(h, w), t, chunk_size=chunk_size),
        ),
        fused_path(fused["fused_linear"], chunk_size),
        fused_path(fused["fused_2pass"], chunk_size),
    ]


__all__ = [
    "FUSED_VARIANTS",
    "FusedVariant",
    "LogprobPath",
    "LossPathFn",
    "PLUGIN_PATHS",
    "fused_path",
    "lm_head_logits",
    "logprob_paths",
    "naive_logprobs",
]
