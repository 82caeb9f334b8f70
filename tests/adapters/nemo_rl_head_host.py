"""A model of NeMo-RL's fused log-prob head (NVIDIA-NeMo/RL @7ea279ab, ``nemo_rl/distributed/model_utils.py``), for
tests: written from what NeMo-RL's code computes, not copied from it. Standard library and torch only (no plugin
import): the worker-environment tests install this file as ``nemo_rl/distributed/model_utils.py`` of a stand-in
``nemo_rl`` tree on an interpreter that does not import the plugin by itself.

What NeMo-RL's ``from_parallel_hidden_states_to_logprobs(hidden, weight, runtime_gather_output, target,
vocab_start_index, vocab_end_index, tp_group, inference_only=False, cp_group=None, chunk_size=None)`` computes:

- asserts that ``cp_group`` is None or of size 1; rolls ``target [B, S]`` left by one along the sequence;
- ``ChunkedDistributedHiddenStatesToLogprobs``: hidden states ``[S/TP, B, H]`` all-gathered over TP along dim 0
  whenever TP > 1; per chunk of ``chunk_size`` sequence positions the logits ``h W^T`` cast to fp32 (here: at least
  fp32, so fp64 inputs give an fp64 model), the vocab-parallel log-softmax (MAX and SUM all-reduced over TP), the
  target's log-prob on the owning rank and 0 elsewhere, then one SUM all-reduce of ``[B, S]``; a target no rank owns
  gives 0. Backward: the logits and softmax recomputed per chunk, ``d = g (onehot - p)`` (onehot only on the owning
  rank), ``dX = d W`` and ``dW += d^T X`` in fp32, then dX reduce-scattered over TP along dim 0. Nothing is saved
  with ``inference_only``;
- returns ``[B, S - 1]`` (the last position scores the wrapped-around first token and is dropped).

``_gpt_forward_with_linear_ce_fusion`` stands in for NeMo-RL's patched ``GPTModel.forward``: it looks the function up
by name in this module at call time, as NeMo-RL's does (which is what makes replacing the module attribute work).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _rank(group) -> int:
    return 0 if group is None else dist.get_rank(group)


def _all_reduce(x: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    if _size(group) > 1:
        dist.all_reduce(x, op=op, group=group)
    return x


def _gather_rows(x: torch.Tensor, group) -> torch.Tensor:
    if _size(group) == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=0)


def _log_softmax_tp(logits: torch.Tensor, group) -> torch.Tensor:
    """``log softmax`` over the whole vocabulary of logits whose last dim is this rank's shard."""
    m = _all_reduce(logits.amax(dim=-1, keepdim=True), group, dist.ReduceOp.MAX)
    s = _all_reduce((logits - m).exp().sum(dim=-1, keepdim=True), group)
    return logits - m - s.log()


class ChunkedDistributedHiddenStatesToLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, target, weight, start, end, chunk_size, tp_group, inference_only=False):
        acc = torch.promote_types(hidden.dtype, torch.float32)
        not_owned = (target < start) | (target >= end)
        local = torch.where(not_owned, 0, target - start)
        full = _gather_rows(hidden, tp_group)
        out = []
        for c0 in range(0, full.shape[0], chunk_size):
            z = torch.matmul(full[c0 : c0 + chunk_size], weight.t()).to(acc).transpose(0, 1)  # [B, c, V/TP]
            lp = _log_softmax_tp(z, tp_group).gather(-1, local[:, c0 : c0 + chunk_size, None]).squeeze(-1)
            out.append(torch.where(not_owned[:, c0 : c0 + chunk_size], 0.0, lp))
        logprobs = _all_reduce(torch.cat(out, dim=1), tp_group)
        if not inference_only:
            ctx.save_for_backward(hidden, weight, local, not_owned)
            ctx.chunk_size, ctx.tp_group = chunk_size, tp_group
        return logprobs

    @staticmethod
    def backward(ctx, grad):
        hidden, weight, local, not_owned = ctx.saved_tensors
        group, chunk = ctx.tp_group, ctx.chunk_size
        acc = torch.promote_types(hidden.dtype, torch.float32)
        full = _gather_rows(hidden, group)
        dx = torch.empty(full.shape, dtype=acc, device=full.device)
        dw = torch.zeros(weight.shape, dtype=acc, device=weight.device)
        for c0 in range(0, full.shape[0], chunk):
            x_c = full[c0 : c0 + chunk]  # [c, B, H]
            z = torch.matmul(x_c, weight.t()).to(acc).transpose(0, 1)
            p = _log_softmax_tp(z, group).exp()
            onehot = torch.zeros_like(p).scatter_(-1, local[:, c0 : c0 + chunk, None], 1.0)
            onehot = onehot * (~not_owned[:, c0 : c0 + chunk, None])
            d = (onehot - p) * grad[:, c0 : c0 + chunk, None].to(acc)  # [B, c, V/TP]
            dx[c0 : c0 + chunk] = torch.matmul(d, weight.to(acc)).transpose(0, 1)
            dw += torch.einsum("bcv,cbh->vh", d, x_c.to(acc))
        size = _size(group)
        dx = _all_reduce(dx, group).chunk(size, dim=0)[_rank(group)].contiguous()
        return dx, None, dw.to(weight.dtype), None, None, None, None, None


def from_parallel_hidden_states_to_logprobs(
    tensor_parallel_hidden_states,
    output_weight_layer,
    runtime_gather_output,
    target,
    vocab_start_index,
    vocab_end_index,
    tp_group,
    inference_only=False,
    cp_group=None,
    chunk_size=None,
):
    target = target.roll(shifts=-1, dims=-1)
    assert cp_group is None or dist.get_world_size(cp_group) == 1, "Context parallelism is not supported"
    logprobs = ChunkedDistributedHiddenStatesToLogprobs.apply(
        tensor_parallel_hidden_states,
        target,
        output_weight_layer,
        vocab_start_index,
        vocab_end_index,
        chunk_size,
        tp_group,
        inference_only,
    ).contiguous()
    return logprobs[:, :-1]


def _gpt_forward_with_linear_ce_fusion(hidden_states, weight, labels, tp_group, inference_only=False, chunk_size=256):
    """The patched GPTModel.forward's last step: the function looked up by name in this module at call time."""
    rank = _rank(tp_group)
    start = rank * weight.shape[0]
    return from_parallel_hidden_states_to_logprobs(
        hidden_states,
        weight,
        None,
        labels,
        vocab_start_index=start,
        vocab_end_index=start + weight.shape[0],
        inference_only=inference_only,
        tp_group=tp_group,
        cp_group=None,
        chunk_size=chunk_size,
    )
