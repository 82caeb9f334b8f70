"""The log-prob paths the benchmark compares, all with one signature: ``(hidden, weight, target) -> logprobs``.

Shapes: ``hidden [..., H]``, ``weight [V, H]`` (one TP rank's shard in the benchmark: the local work, no collective),
``target [...]`` ids; returns fp32 ``[...]``, differentiable w.r.t. ``hidden`` and ``weight``.

- ``naive``: NeMo-RL's default (``DistributedLogprob``): full logits ``[N, V]``, fp32 ``log_softmax`` (saved for
  backward), gather. Also the test reference.
- ``from_logits``: the full logits, then issue 3's chunked ``vocab_parallel_logprobs`` (online lse per chunk, saves
  ``lse [N]`` and the logits by reference, recomputing backward): no fp32 softmax, but the ``[N, V]`` logits live.
- ``fused_linear``: ``fused_linear_logprobs`` for the forward; its forward+backward is ``fused_linear_pg_loss``, which
  for the benchmark's token-level loss runs the single pass (3 GEMMs, gradients computed chunk by chunk in the forward).
- ``fused_2pass``: the same loss entry forced to the two-pass schedule (log-probs, loss, recomputing backward: 4 GEMMs),
  what the sequence-level ratios cost. Its forward is ``fused_linear``'s, so only its forward+backward runs.
- Liger's chunked GRPO loss computes its own loss, so it lives in :mod:`nemo_is_plugin.bench.liger`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from nemo_is_plugin.bench.problem import HeadProblem
from nemo_is_plugin.distributed.fused_linear import fused_linear_logprobs
from nemo_is_plugin.distributed.fused_linear_loss import fused_linear_pg_loss
from nemo_is_plugin.distributed.vocab_parallel import vocab_parallel_logprobs

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
    has its own ``loss`` entry. ``times_forward=False``: the forward is another path's (not timed twice)."""

    name: str
    description: str
    fn: LogprobFn
    loss: Optional[LossPathFn] = None
    times_forward: bool = True


def _fused_loss(single_pass: Optional[bool], chunk_kw: dict) -> LossPathFn:
    def run(loss_fn, problem: HeadProblem, h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        loss, _ = fused_linear_pg_loss(
            loss_fn, h, w, problem.target, problem.data, problem.global_valid_seqs, problem.global_valid_toks,
            single_pass=single_pass, **chunk_kw,
        )
        return loss

    return run


def logprob_paths(chunk_size: Optional[int] = None) -> list[LogprobPath]:
    """The paths in benchmark order; ``chunk_size`` (tokens per chunk) for the chunked ones, None = their default."""
    fused_kw = {} if chunk_size is None else {"chunk_size": chunk_size}
    logits_kw = {} if chunk_size is None else {"chunk_size": chunk_size}
    return [
        LogprobPath("naive", "full logits + fp32 log_softmax (NeMo-RL DistributedLogprob)", naive_logprobs),
        LogprobPath(
            "from_logits",
            "full logits + chunked online-lse log-prob, recomputing backward (vocab_parallel)",
            lambda h, w, t: vocab_parallel_logprobs(lm_head_logits(h, w), t, **logits_kw),
        ),
        LogprobPath(
            "fused_linear",
            "hidden states + LM-head shard, chunked; loss in one pass for token-level ratios (fused_linear_loss)",
            lambda h, w, t: fused_linear_logprobs(h, w, t, **fused_kw),
            loss=_fused_loss(None, fused_kw),
        ),
        LogprobPath(
            "fused_2pass",
            "the same, two-pass schedule: log-probs, loss, recomputing backward (sequence-level ratios)",
            lambda h, w, t: fused_linear_logprobs(h, w, t, **fused_kw),
            loss=_fused_loss(False, fused_kw),
            times_forward=False,
        ),
    ]


__all__ = ["LogprobPath", "LossPathFn", "lm_head_logits", "logprob_paths", "naive_logprobs"]
