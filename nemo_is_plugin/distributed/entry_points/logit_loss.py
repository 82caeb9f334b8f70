"""The LOGIT entry point: the loss from vocab- and context-parallel logits, without gathering vocab or sequence.

Called the way NeMo-RL's Megatron worker calls a LOGIT loss (NVIDIA-NeMo/RL at 7ea279abfbeb698b092856d0dab61e7cf39bc909,
``nemo_rl/models/megatron/train.py``):

    loss, metrics = loss_fn(logits, data, global_valid_seqs, global_valid_toks,
                            vocab_parallel_rank=..., vocab_parallel_group=..., context_parallel_group=...,
                            dp_group=...)   # the last one the plugin's: batch statistics over DP

``dp_group`` is the data-parallel group's name at every entry point (the fused loss, slime's, the DP helpers);
``data_parallel_group=``, this entry point's former name for it, still works and warns (DeprecationWarning).

- ``logits``: this rank's ``[B, S_local, V/TP]`` (padded batch; ``S_local = S_pad / cp``) or ``[1, N_local, V/TP]`` /
  ``[N_local, V/TP]`` (packed, with ``cu_seqlens_padded``), in the CP order the model ran with (Megatron's
  load-balanced order by default). bf16 or fp32.
- ``data``: NeMo-RL's un-sharded ``[B, S]`` tensors (``input_ids``, ``token_mask``, ``advantages``, ``prev_logprobs``,
  ``generation_logprobs``, optional ``reference_policy_logprobs``), ``sample_mask [B]``, optional ``rewards [B]``;
  with ``score_centering``, the sampler's head ``rollout_topk_ids`` / ``rollout_topk_logprobs`` ``[B, S, k]``, whose
  trainer log-probs come from the labels' pass (``kernels/head_ids.py``: same lse, one all-reduce over TP).

Position s of the logits predicts token s+1, so the data are shifted left by one (NeMo-RL's ``[:, 1:]`` slice), the last
position and every padding position masked out, and then each rank keeps its own tokens. The log-probs come from the
chunked vocab-parallel kernel; the loss is :meth:`ClippedPGLoss.compute` on a CP layout, so every sequence-level and
prefix quantity spans the CP group. Each CP rank returns the loss of its own tokens (their sum over the CP group is the
single-process loss; TP ranks return the same value) and the full-batch metrics.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from nemo_is_plugin.distributed.head.vocab_parallel import vocab_parallel_logprobs
from nemo_is_plugin.distributed.parallel.context_parallel import cp_layout
from nemo_is_plugin.distributed.parallel.cp_sharding import CPOrder
from nemo_is_plugin.distributed.parallel.data_parallel import with_data_parallel
from nemo_is_plugin.distributed.parallel.groups import ProcessGroup, group_rank, group_size
from nemo_is_plugin.loss.aligned_inputs import HEAD_KEYS, TRAINER_HEAD_KEY
from nemo_is_plugin.loss.clipped_pg import TOKEN_KEYS, ClippedPGLoss, LossInputs
from nemo_is_plugin.loss.layout import TokenLayout, host_ints
from nemo_is_plugin.loss.masked import EPS, where_mask
from nemo_is_plugin.loss.score_centering import check_head_shapes

_UNSET: Any = object()


def _dp_group_alias(dp_group: ProcessGroup | None, data_parallel_group: Any) -> ProcessGroup | None:
    """``dp_group``, or the group given under its deprecated name ``data_parallel_group`` (a warning); both: an
    error (the ``**_`` of the call signature would otherwise hide a misspelt or doubled group)."""
    if data_parallel_group is _UNSET:
        return dp_group
    if dp_group is not None:
        raise TypeError(
            "LogitClippedPGLoss: pass the data-parallel group once, as dp_group= (data_parallel_group= is "
            "its deprecated name)"
        )
    warnings.warn(
        "LogitClippedPGLoss(data_parallel_group=...) is deprecated: pass dp_group=... (every entry point's name)",
        DeprecationWarning,
        stacklevel=3,
    )
    return data_parallel_group


def next_token_aligned(x: torch.Tensor, width: int) -> torch.Tensor:
    """``[B, S, ...]`` -> ``[B, width, ...]`` with ``out[:, s] = x[:, s + 1]``; zeros past ``S - 1`` (masked there)."""
    out = x.new_zeros((x.shape[0], width) + tuple(x.shape[2:]))
    n = min(x.shape[1] - 1, width)
    out[:, :n] = x[:, 1 : n + 1]
    return out


def _local(aligned: torch.Tensor, layout: TokenLayout) -> torch.Tensor:
    """The values of this rank's tokens: ``aligned[seq, position]``, shaped like the layout."""
    return aligned[layout.seq_index, layout.position]


def logit_loss_inputs(
    logits: torch.Tensor,
    data: Mapping[str, torch.Tensor],
    global_valid_seqs: torch.Tensor | float,
    global_valid_toks: torch.Tensor | float,
    *,
    tp_group: ProcessGroup | None = None,
    cp_group: ProcessGroup | None = None,
    cp_order: CPOrder = "load_balanced",
    cu_seqlens_padded: torch.Tensor | Sequence[int] | None = None,
    chunk_size: int | None = None,
    with_entropy: bool = False,
    with_head: bool = False,
) -> tuple[LossInputs, TokenLayout, torch.Tensor | None]:
    """Build (LossInputs, CP layout, entropy or None) for this rank's tokens. See the module docstring for shapes.

    ``with_head`` (score centering): ``data['rollout_topk_ids']`` and ``['rollout_topk_logprobs']`` ``[B, S, k]`` are
    aligned and sharded like the other token tensors, and the trainer's log-probs at the ids (``curr_topk_logprobs``)
    come from the labels' pass and lse (each TP rank gathers the ids it owns; one all-reduce)."""
    ids = data["input_ids"]
    num_seqs, seq_len = ids.shape
    cp = group_size(cp_group)
    if cu_seqlens_padded is None:
        if logits.dim() != 3 or logits.shape[0] != num_seqs:
            raise ValueError(f"padded logits must be [B={num_seqs}, S_local, V/TP], got {tuple(logits.shape)}")
        width = logits.shape[1] * cp
        if width < seq_len:
            raise ValueError(f"logits cover {width} positions over {cp} CP ranks but input_ids has {seq_len}")
        layout = cp_layout(cp_group, cp_order, num_seqs=num_seqs, seq_len=width, device=logits.device)
    else:
        cu = host_ints(cu_seqlens_padded)  # one host sync for a device tensor, none for Python ints
        if len(cu) - 1 != num_seqs:
            raise ValueError(f"cu_seqlens_padded holds {len(cu) - 1} sequences but data has {num_seqs}")
        width = max(max((b - a for a, b in zip(cu[:-1], cu[1:])), default=0), seq_len)
        layout = cp_layout(cp_group, cp_order, cu_seqlens_padded=cu, device=logits.device)
        logits = logits.reshape(-1, logits.shape[-1])
        if logits.shape[0] * cp != cu[-1]:
            raise ValueError(f"packed logits hold {logits.shape[0]} tokens x {cp} CP ranks, cu_seqlens {cu[-1]}")

    target = _local(next_token_aligned(ids, width), layout)
    local = {k: _local(next_token_aligned(data[k], width), layout) for k in TOKEN_KEYS if k in data}
    if with_head:
        local.update(_local_head(data, layout, width))
    head_ids = local.get(HEAD_KEYS[0])
    out = vocab_parallel_logprobs(
        logits,
        target.reshape(logits.shape[:-1]),
        tp_group,
        chunk_size=chunk_size,
        with_entropy=with_entropy,
        head_ids=None if head_ids is None else head_ids.reshape(*logits.shape[:-1], head_ids.shape[-1]),
    )
    outs = list(out) if isinstance(out, tuple) else [out]
    curr, entropy = outs[0], outs[1] if with_entropy else None
    shape = layout.shape
    if head_ids is not None:
        local[TRAINER_HEAD_KEY] = outs[-1].reshape(*shape, head_ids.shape[-1])
    inputs = LossInputs.from_tokens(curr.reshape(shape), local, data, global_valid_seqs, global_valid_toks)
    return inputs, layout, None if entropy is None else entropy.reshape(shape)


def _local_head(data: Mapping[str, torch.Tensor], layout: TokenLayout, width: int) -> dict[str, torch.Tensor]:
    """This rank's ``[*T_local, k]`` score-centering head tensors of ``data``'s ``[B, S, k]`` ones."""
    missing = [k for k in HEAD_KEYS if k not in data]
    if missing:
        raise KeyError(
            f"score_centering: true needs data[{missing[0]!r}] [B, S, k] (the sampler's top-k head of each token); "
            "set score_centering: false or record the head (docs/config.md)"
        )
    batch = tuple(data["input_ids"].shape)
    for key in HEAD_KEYS:
        if data[key].dim() != 3 or tuple(data[key].shape[:2]) != batch:
            raise ValueError(
                f"data[{key!r}] has shape {list(data[key].shape)}, expected [B, S, k] with [B, S] = {list(batch)}"
            )
    return {k: _local(next_token_aligned(data[k], width), layout) for k in HEAD_KEYS}


class LogitClippedPGLoss:
    """ClippedPGLoss taking vocab-parallel, context-parallel logits (NeMo-RL's LOGIT input type).

    Args:
        loss: the loss (its config decides everything about the math).
        cp_order: the CP order the model used ("load_balanced", Megatron's, or "contiguous").
        chunk_size: tokens per fp32 chunk of the log-prob kernel.
        log_entropy: also compute the full-vocab entropy and report its token mean as metric ``entropy``.
        host_divides_by_cp: set when the host divides the returned loss by the CP size (NeMo-RL's ``cp_normalize``,
            meant for losses that are replicated on every CP rank); the loss is then multiplied by it to compensate.
    """

    def __init__(
        self,
        loss: ClippedPGLoss,
        *,
        cp_order: CPOrder = "load_balanced",
        chunk_size: int | None = None,
        log_entropy: bool = False,
        host_divides_by_cp: bool = False,
    ):
        self.loss, self.cp_order, self.chunk_size = loss, cp_order, chunk_size
        self.log_entropy, self.host_divides_by_cp = log_entropy, host_divides_by_cp

    def __call__(
        self,
        logits: torch.Tensor,
        data: Mapping[str, torch.Tensor],
        global_valid_seqs: torch.Tensor | float,
        global_valid_toks: torch.Tensor | float,
        vocab_parallel_rank: int | None = None,
        vocab_parallel_group: ProcessGroup | None = None,
        context_parallel_group: ProcessGroup | None = None,
        *,
        dp_group: ProcessGroup | None = None,
        data_parallel_group: Any = _UNSET,
        cu_seqlens_padded: torch.Tensor | Sequence[int] | None = None,
        extra_metric_sums: Callable[[LossInputs, TokenLayout], Mapping[str, torch.Tensor]] | None = None,
        **_: Any,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """The loss of this rank's logits (module docstring). ``dp_group``: the DP ranks a batch statistic (an
        objective's) is reduced over, beside the CP group; None: this call's batch alone. Every DP rank must then
        make the same calls. ``data_parallel_group``: the deprecated name of ``dp_group``. ``extra_metric_sums``: a
        caller's own 0-d additive metric shares computed from this rank's inputs and CP layout, reported with the
        loss's metrics in their single host read (``ClippedPGLoss.compute``'s argument of that name)."""
        dp_group = _dp_group_alias(dp_group, data_parallel_group)
        if vocab_parallel_rank is not None and vocab_parallel_rank != group_rank(vocab_parallel_group):
            raise ValueError(
                f"vocab_parallel_rank={vocab_parallel_rank} but this process is rank "
                f"{group_rank(vocab_parallel_group)} of vocab_parallel_group"
            )
        inputs, layout, entropy = logit_loss_inputs(
            logits,
            data,
            global_valid_seqs,
            global_valid_toks,
            tp_group=vocab_parallel_group,
            cp_group=context_parallel_group,
            cp_order=self.cp_order,
            cu_seqlens_padded=cu_seqlens_padded,
            chunk_size=self.chunk_size,
            with_entropy=self.log_entropy,
            with_head=self.loss.config.score_centering,
        )
        if self.loss.config.score_centering:
            head = inputs.head
            assert head is not None  # logit_loss_inputs raised for a missing one
            top_k = self.loss.config.score_centering_top_k
            check_head_shapes(layout.shape, top_k, head.head_ids, head.sampler_head, head.trainer_head)
        layout = with_data_parallel(layout, dp_group)
        extra = dict(extra_metric_sums(inputs, layout)) if extra_metric_sums is not None else {}
        if entropy is not None:
            valid = inputs.token_mask * layout.to_tokens(inputs.sample_mask.to(inputs.token_mask.dtype))
            n_tok = torch.as_tensor(global_valid_toks, dtype=torch.float64, device=entropy.device)
            extra["entropy"] = where_mask(entropy.detach().double(), valid).sum() / (n_tok + EPS)
        loss, metrics = self.loss.compute(inputs, layout, extra_metric_sums=extra)
        if self.host_divides_by_cp:
            loss = loss * group_size(context_parallel_group)
        return loss, metrics


__all__ = ["LogitClippedPGLoss", "logit_loss_inputs", "next_token_aligned"]
