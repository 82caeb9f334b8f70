"""The policy-gradient loss straight from hidden states and the vocab-sharded LM head, in one pass when it can be.

Shapes: ``hidden [B, T, H]`` (T next-token positions; replicated over TP, or sharded over dim 0 with
``sequence_parallel``), ``weight [V/TP, H]``, ``target [B, T]`` global ids; ``data`` NeMo-RL's ``[B, S = T+1]`` batch.

Two schedules, same loss, metrics and gradients:

- **single pass** (token-level ratio or REINFORCE, any IS level / truncation / KL / aggregation; and CTPO's cumulative
  ratios when the layout holds whole sequences in memory order, see :mod:`nemo_is_plugin.separable`). ``dL/dc_t`` is
  known once the log-probs up to ``t`` are, so each chunk does its whole job in the forward: logits ``z = X_c W^T``
  (GEMM 1), softmax partials and their TP merge, ``c``, ``g = dL/dc``
  (:class:`~nemo_is_plugin.separable.TokenLossGradient`), ``dz = g (onehot - p)`` in the logits' own buffer,
  ``dX_c = dz W`` (GEMM 2), ``dW += dz^T X_c`` (GEMM 3). 3 GEMMs in all, like the naive path, instead of the
  recomputing backward's 4; ``dX`` and ``dW`` are kept for the backward, which only scales them by the upstream
  gradient. TP costs 2 collectives per chunk (the chunk's partials) + 1 all-reduce of ``dX``.
- **two pass** (``sequence`` / ``sequence_token`` ratios, ``force_on_policy_ratio``, cumulative ratios on a layout
  out of memory order): :func:`fused_linear_logprobs` (log-probs of every token), the loss on them, then its
  recomputing backward: the loss gradient of a token needs log-probs that come later.

Parallelism: TP (vocab-sharded weight) and sequence parallelism; not CP (the batch would need the sharding that
:class:`~nemo_is_plugin.distributed.logit_loss.LogitClippedPGLoss` does: use that entry point under CP).

Either way no more than one ``[chunk, V/TP]`` fp32 buffer of logits is alive. The loss value and the metrics are
always :meth:`ClippedPGLoss.compute` on the final log-probs, as in the two-pass path.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional

import torch

from nemo_is_plugin.distributed.collectives import all_gather, all_reduce_sum
from nemo_is_plugin.distributed.fused_linear import (
    acc_dtype,
    add_chunk_grads,
    check_head_inputs,
    chunk_logits,
    chunk_slices,
    compute_dtype,
    fused_linear_logprobs,
)
from nemo_is_plugin.distributed.groups import ProcessGroup, group_rank
from nemo_is_plugin.distributed.vocab_parallel import (
    finalize_partials,
    local_vocab_range,
    localize_target,
    reduce_partials,
)
from nemo_is_plugin.kernels.chunk_inplace import chunk_partials_, softmax_grad_from_exp_
from nemo_is_plugin.layout import TokenLayout
from nemo_is_plugin.loss import ClippedPGLoss
from nemo_is_plugin.separable import TokenLossGradient, single_pass_blocker


class _SinglePassFusedLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, target, token_grad, finish, tp_group, chunk_size, inv_temperature,
                reduce_grad_hidden):
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        x = hidden.reshape(-1, hidden.shape[-1])
        start, end = local_vocab_range(weight.shape[0], group_rank(tp_group))
        local_t, owned = localize_target(target.reshape(-1), start, end)
        dtype = compute_dtype(x)
        w = weight.to(dtype)  # no copy unless the CPU upcast applies
        acc = acc_dtype(dtype)
        n = x.shape[0]
        buf = torch.empty(min(chunk_size, n), w.shape[0], dtype=acc, device=x.device)
        logprob = torch.empty(n, dtype=acc, device=x.device)
        grad_x = torch.empty(x.shape, dtype=dtype, device=x.device) if need_x else None
        grad_w = None
        for sl in chunk_slices(n, chunk_size):
            x_c = x[sl].to(dtype)
            z = chunk_logits(x_c, w, inv_temperature, buf)  # GEMM 1
            local = chunk_partials_(z, local_t[sl], owned[sl], False)  # z := exp(z - m_local)
            lp, lse, _ = finalize_partials(reduce_partials(local, tp_group))
            logprob[sl] = lp
            g = token_grad(sl, lp).to(acc)
            dz = softmax_grad_from_exp_(z, torch.exp(local.max - lse), local_t[sl], owned[sl], g)
            if inv_temperature != 1.0:
                dz.mul_(inv_temperature)
            dz = dz.to(dtype)  # no-op on CPU; bf16 operands for the GPU GEMMs
            grad_w = add_chunk_grads(dz, w, x_c, grad_x[sl] if need_x else None, grad_w, need_w)  # GEMMs 2 and 3
        del buf
        if need_w and grad_w is None:  # no tokens
            grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device)
        if need_x and reduce_grad_hidden:
            grad_x = all_reduce_sum(grad_x, tp_group)  # each rank holds its vocab shard's share of dX
        ctx.grad_x = None if grad_x is None else grad_x.to(hidden.dtype).reshape(hidden.shape)
        ctx.grad_w = None if grad_w is None else grad_w.to(weight.dtype)
        return finish(logprob.reshape(target.shape))

    @staticmethod
    def backward(ctx, grad_loss):
        grads = []
        for g in (ctx.grad_x, ctx.grad_w):
            # a plain loss.backward() hands 1: skip a pass over V x H
            grads.append(None if g is None else (g if bool(grad_loss == 1) else g * grad_loss.to(g.dtype)))
        ctx.grad_x = ctx.grad_w = None
        return grads[0], grads[1], None, None, None, None, None, None, None


def fused_linear_pg_loss(
    loss_fn: ClippedPGLoss,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    data: Mapping[str, torch.Tensor],
    global_valid_seqs: torch.Tensor | float,
    global_valid_toks: torch.Tensor | float,
    tp_group: Optional[ProcessGroup] = None,
    *,
    layout: Optional[TokenLayout] = None,
    chunk_size: Optional[int] = None,
    temperature: float = 1.0,
    sequence_parallel: bool = False,
    single_pass: Optional[bool] = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """``loss_fn`` on the log-probs of ``target`` under ``softmax(hidden @ weight.T / temperature)``, chunked.

    Args:
        loss_fn: the configured :class:`ClippedPGLoss`.
        hidden, weight, target, tp_group, chunk_size, temperature, sequence_parallel: as
            :func:`~nemo_is_plugin.distributed.fused_linear.fused_linear_logprobs`.
        data, global_valid_seqs, global_valid_toks, layout: as ``ClippedPGLoss.__call__`` (``data`` is ``[B, S]``).
        single_pass: None = whenever the config and layout allow it (``separable.single_pass_blocker``); True =
            require it (ValueError with the reason otherwise); False = always the two-pass schedule.

    Returns:
        ``(loss, metrics)`` exactly as ``loss_fn(fused_linear_logprobs(...), data, ...)``; the loss is
        differentiable w.r.t. ``hidden`` and ``weight``.
    """
    # shape and dtype only: the log-probs' dtype (fp64 for fp64 inputs, else fp32) sets the dL/dc arithmetic's
    placeholder = torch.zeros(target.shape, dtype=acc_dtype(compute_dtype(hidden)), device=hidden.device)
    inputs, layout = loss_fn.prepare(placeholder, data, global_valid_seqs, global_valid_toks, layout)
    why = single_pass_blocker(loss_fn.config, layout)
    if single_pass and why is not None:
        raise ValueError(f"single_pass=True is not possible here: {why}; pass single_pass=None (auto) or False")
    wants_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    if why is not None or single_pass is False or not wants_grad:
        lp = fused_linear_logprobs(
            hidden, weight, target, tp_group, chunk_size=chunk_size, temperature=temperature,
            sequence_parallel=sequence_parallel,
        )
        return loss_fn(lp, data, global_valid_seqs, global_valid_toks, layout=layout)  # validates lp's values too

    if sequence_parallel:
        hidden = all_gather(hidden, tp_group, dim=0)  # its backward reduce-scatters dX: no all-reduce inside
    chunk = check_head_inputs(hidden, weight, target, temperature, chunk_size)
    token_grad = TokenLossGradient.build(loss_fn, inputs, layout)
    metrics: dict[str, Any] = {}

    def finish(logprob: torch.Tensor) -> torch.Tensor:
        loss, m = loss_fn.compute(dataclasses.replace(inputs, curr_logprobs=logprob), layout)
        metrics.update(m)
        return loss.detach()

    loss = _SinglePassFusedLoss.apply(
        hidden, weight, target, token_grad, finish, tp_group, chunk, 1.0 / temperature, not sequence_parallel
    )
    return loss, metrics


__all__ = ["fused_linear_pg_loss"]
