"""The policy-gradient loss straight from hidden states and the vocab-sharded LM head, in one pass when it can be.

Shapes: ``hidden [B, T, H]`` (T next-token positions; replicated over TP, or sharded over dim 0 with
``sequence_parallel``), ``weight [V/TP, H]``, ``target [B, T]`` global ids; ``data`` NeMo-RL's ``[B, S = T+1]`` batch.

Two schedules, same loss, metrics and gradients:

- **single pass** (token-level ratio or REINFORCE, any IS level / truncation / KL / aggregation; and CTPO's cumulative
  ratios when the layout holds whole sequences in memory order, see :mod:`nemo_is_plugin.loss.separable`). ``dL/dc_t``
  is known once the log-probs up to ``t`` are, so each chunk does its whole job in the forward:

      z = X_c W^T                     GEMM 1, in the compute dtype (bf16 on GPUs)
      pass 1: softmax partials of z / T, their TP merge -> c = log p(target), lse      (no host sync)
      g = dL/dc                       per token (separable.TokenLossGradient: autograd on [chunk] vectors)
      pass 2: dz = g (onehot - p) / T  in z's buffer
      dX_c = dz W                     GEMM 2, into dX's rows
      dW  += dz^T X_c                 GEMM 3, accumulated in place (kernels.gemm.WeightGrad)

  3 GEMMs in all, like the naive path, instead of the recomputing backward's 4; ``dX`` and ``dW`` are kept for the
  backward, which scales them in place by the upstream gradient (on CPU, where reading it costs no device sync, an
  upstream gradient of exactly 1 skips that pass). TP costs 2 collectives per chunk + 1 all-reduce of ``dX``.
- **two pass** (``sequence`` / ``sequence_token`` ratios, ``on_policy`` (pi_old = sg pi), cumulative ratios on a layout
  out of memory order): :func:`fused_linear_logprobs` (log-probs of every token), the loss on them, then its
  recomputing backward: the loss gradient of a token needs log-probs that come later.

Score centering (``score_centering: true``): the head ids ``data['rollout_topk_ids']`` go to the head, whose chunks
also give the head's log-probs from the same lse (:mod:`~nemo_is_plugin.kernels.head_ids`); in the single pass
``g`` of a chunk is ``(dL/dc, dL/d(trainer_head))`` from one autograd call over the term (linear in ``trainer_head``
with detached coefficients), pass 2 runs with ``dL/dc + sum_k dL/d(trainer_head)`` and the ids' columns take their
scatter-adds.

Parallelism: TP (vocab-sharded weight) and sequence parallelism; not CP (the batch would need the sharding that
:class:`~nemo_is_plugin.distributed.entry_points.logit_loss.LogitClippedPGLoss` does: use that entry point under CP).

Compiled (``fused_linear_pg_loss(CompiledLoss(loss_fn), ...)``, ``loss/compiled.py``): in the single pass the batch
constants, each chunk's ``[n]`` step (:func:`chunk_step`: the log-probs from the merged partials and dL/dc, one graph
compiled once for every chunk size) and the loss with its metrics are compiled graphs, and the inputs' value checks are
read with the metrics: one host read per call, at the end of the forward (a bad input raises there, with eager's
message). The GEMMs and the two ``[n, V]`` passes are unchanged. The two-pass path calls the compiled loss on the
log-probs. Layouts the compiled loss does not take (a DP batch group) run eagerly after a one-time warning.

Either way no more than one chunk of logits is alive. The loss value and the metrics are always the loss on the final
log-probs, as in the two-pass path: :meth:`ClippedPGLoss.compute` (reusing the IS correction the gradient was built
with), or, with a compiled loss, its compiled epilogue (which computes the correction inside its graph). Cost model
per chunk element (bf16, Triton): pass 1 reads 2 bytes, pass 2 reads 2 and writes 2.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch

from nemo_is_plugin.distributed.head.fused_linear import (
    HeadChunks,
    HeadOptions,
    check_grad_weight_out,
    check_lm_head_call,
    chunk_logits,
    fused_linear_logprobs,
)
from nemo_is_plugin.distributed.head.vocab_parallel import reduce_partials_and_head
from nemo_is_plugin.distributed.parallel.collectives import all_gather
from nemo_is_plugin.distributed.parallel.data_parallel import with_data_parallel
from nemo_is_plugin.distributed.parallel.groups import ProcessGroup
from nemo_is_plugin.kernels.gemm import acc_dtype, compute_dtype
from nemo_is_plugin.kernels.head_ids import dense_grad, head_logprobs, valid_head_grad
from nemo_is_plugin.kernels.softmax_partials import SoftmaxPartials, finalize_partials
from nemo_is_plugin.loss import ClippedPGLoss
from nemo_is_plugin.loss.aligned_inputs import HEAD_KEYS, TRAINER_HEAD_KEY
from nemo_is_plugin.loss.compiled import CompiledLoss, PreparedInputs
from nemo_is_plugin.loss.layout import TokenLayout
from nemo_is_plugin.loss.separable import ChunkPrefix, TokenLossGradient, chunk_gradient, single_pass_blocker
from nemo_is_plugin.loss.terms import TermInputs


def _is_one_on_cpu(s: torch.Tensor) -> bool:
    """True when the upstream gradient is exactly 1 and held on the CPU, where reading it is free (on a GPU it would
    be a host sync, so there the gradients are always scaled)."""
    return s.device.type == "cpu" and bool(s == 1)


def _scale_(grad: torch.Tensor | None, s: torch.Tensor, skip: bool) -> torch.Tensor | None:
    """``grad * s`` in place (no second dX- or dW-sized buffer)."""
    return grad if grad is None or skip else grad.mul_(s.to(grad.dtype))


def _log_probs_into(
    merged: SoftmaxPartials,
    head_z: torch.Tensor | None,
    head_valid: torch.Tensor | None,
    logprob_out: torch.Tensor,
    head_out: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The chunk's log-probs from the TP-merged partials, written into ``logprob_out`` (the head's, ``[n, k]``, into
    ``head_out``): ``(log-probs [n], lse [n], head log-probs or None)``."""
    lp, lse, _ = finalize_partials(merged)
    logprob_out.copy_(lp)
    if head_z is None or head_valid is None or head_out is None:
        return lp, lse, None
    trainer_head = head_logprobs(head_z, lse, head_valid)
    head_out.copy_(trainer_head)
    return lp, lse, trainer_head


def _dense_head_grad(
    g: torch.Tensor, g_head: torch.Tensor | None, head_valid: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(g + sum_k g_k, g_k)`` with the head's gradient zeroed at invalid ids (``(g, None)`` without a head)."""
    if g_head is None or head_valid is None:
        return g, None
    g_head = valid_head_grad(g_head, head_valid, g.dtype)
    return dense_grad(g, g_head), g_head


def chunk_step(
    t: TermInputs,
    a: torch.Tensor,
    prefix: ChunkPrefix | None,
    merged: SoftmaxPartials,
    head_z: torch.Tensor | None,
    head_valid: torch.Tensor | None,
    logprob_out: torch.Tensor,
    head_out: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The ``[n]`` work of one chunk between pass 1 and pass 2: its log-probs (:func:`_log_probs_into`) and its loss
    gradient (``separable.chunk_gradient`` on its constants ``t``, weights ``a`` and prefix state). Returns ``(lse,
    g = dL/dc (+ sum_k dL/dc_k), dL/dc_k or None, the prefix carry or None)``. A function of tensors, so that a
    compiled loss compiles it whole (one graph a chunk)."""
    lp, lse, trainer_head = _log_probs_into(merged, head_z, head_valid, logprob_out, head_out)
    g, g_head, carry = chunk_gradient(t, a, lp, trainer_head, prefix)
    return lse, *_dense_head_grad(g, g_head, head_valid), carry


ChunkStep = Callable[..., tuple[torch.Tensor, torch.Tensor, "torch.Tensor | None"]]


def loss_gradient_step(token_grad: TokenLossGradient, step: Callable[..., Any] = chunk_step) -> ChunkStep:
    """The single pass's step ``(sl, merged, head_z, head_valid, logprob_out, head_out) -> (lse, g, g_head)``:
    ``step`` (:func:`chunk_step` or its compiled form) on the chunk's constants, the prefix carried on."""

    def run(sl: slice, *args: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        lse, g, g_head, carry = step(*token_grad.chunk_inputs(sl), *args)
        token_grad.advance(carry)
        return lse, g, g_head

    return run


def token_grad_step(token_grad: Callable[..., Any]) -> ChunkStep:
    """A step from any ``token_grad(sl, c) -> dL/dc`` (with a head: ``token_grad(sl, c, trainer_head) -> (dL/dc,
    dL/dc_k)``): the head-cost benchmark and the head's tests drive the single pass with fixed coefficients."""

    def run(sl: slice, merged, head_z, head_valid, logprob_out, head_out):
        lp, lse, trainer_head = _log_probs_into(merged, head_z, head_valid, logprob_out, head_out)
        if trainer_head is None:
            return lse, token_grad(sl, lp), None
        g, g_head = token_grad(sl, lp, trainer_head)
        return lse, *_dense_head_grad(g, g_head, head_valid)

    return run


class _SinglePassFusedLoss(torch.autograd.Function):
    """The single pass. ``step(sl, merged, head_z, head_valid, logprob_out, head_out) -> (lse, g, g_head)`` is
    each chunk's ``[n]`` work between its passes (:func:`loss_gradient_step`, :func:`token_grad_step`);
    ``finish(logprob, trainer_head)`` (``trainer_head`` None without ``head_ids``) returns the loss value.
    ``read_upstream``: on a CPU, skip scaling the gradients by an upstream gradient of exactly 1 (one host read; a
    compiled loss keeps its one read for the metrics)."""

    @staticmethod
    def forward(ctx, hidden, weight, target, head_ids, step, finish, opts: HeadOptions, read_upstream=True):
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        # a caller's main_grad buffer receives dW scaled by the upstream gradient, known in the backward only
        chunks = HeadChunks.build(hidden, weight, target, head_ids, dataclasses.replace(opts, grad_weight_out=None))
        logprob = torch.empty(chunks.n, dtype=chunks.acc, device=chunks.x.device)
        trainer_head = None if chunks.head is None else logprob.new_empty(chunks.head[0].shape)
        grad_x, grad_w = chunks.grad_buffers(need_x, need_w, weight)
        inv_t = opts.inv_temperature
        for sl in chunks.slices():
            x_c = chunks.x[sl].to(chunks.dtype)
            z = chunk_logits(x_c, chunks.w, chunks.zbuf)  # GEMM 1
            lt, ow, col = chunks.rows(sl)
            head_z = chunks.head_logits(sl, z)  # before pass 1 consumes z
            local = chunks.math.partials(z, lt, ow, col, inv_t)  # pass 1
            merged, head_z = reduce_partials_and_head(local, head_z, opts.tp_group)  # one all-reduce SUM
            valid = None if chunks.head is None else chunks.head[2][sl]
            head_out = None if trainer_head is None else trainer_head[sl]
            lse, g, g_head = step(sl, merged, head_z, valid, logprob[sl], head_out)
            dz = chunks.math.single_pass_grad(z, local, lse, lt, ow, col, g, inv_t, inv_t)  # pass 2
            dz = chunks.add_head_grad_(sl, dz, g_head)
            chunks.chunk_grads(sl, dz, x_c, grad_x, grad_w)  # GEMMs 2 and 3
        ctx.grad_x = chunks.finish_grad_x(grad_x, hidden)
        del chunks
        ctx.grad_weight_out, ctx.read_upstream = opts.grad_weight_out, read_upstream
        if grad_w is None:
            ctx.grad_w = None
        elif opts.grad_weight_out is not None:
            ctx.grad_w = grad_w.buf if grad_w.buf is not None else torch.zeros_like(opts.grad_weight_out)
        else:
            ctx.grad_w = grad_w.result()
        trainer_head = None if trainer_head is None else trainer_head.reshape(head_ids.shape)
        return finish(logprob.reshape(target.shape), trainer_head)

    @staticmethod
    def backward(ctx, grad_loss):
        skip = ctx.read_upstream and _is_one_on_cpu(grad_loss)
        grad_x = _scale_(ctx.grad_x, grad_loss, skip)
        grad_w = None
        if ctx.grad_weight_out is not None and ctx.grad_w is not None:
            ctx.grad_weight_out.addcmul_(ctx.grad_w, grad_loss.to(ctx.grad_weight_out.dtype))  # main_grad += s dW
        else:
            grad_w = _scale_(ctx.grad_w, grad_loss, skip)
        ctx.grad_x = ctx.grad_w = ctx.grad_weight_out = None
        return grad_x, grad_w, None, None, None, None, None, None


def _with_head_placeholder(
    loss_fn: ClippedPGLoss | CompiledLoss, data: Mapping[str, torch.Tensor], placeholder: torch.Tensor
) -> Mapping[str, torch.Tensor]:
    """Score centering: the head log-probs this entry point computes stand as zeros ``[B, T, k]`` while the inputs
    are prepared (shape and dtype only; without head ids ``prepare`` names what is missing)."""
    ids = data.get(HEAD_KEYS[0])
    if not loss_fn.config.score_centering or ids is None or TRAINER_HEAD_KEY in data:
        return data
    return {**data, TRAINER_HEAD_KEY: placeholder.new_zeros((*placeholder.shape, ids.shape[-1]))}


def fused_linear_pg_loss(
    loss_fn: ClippedPGLoss | CompiledLoss,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    data: Mapping[str, torch.Tensor],
    global_valid_seqs: torch.Tensor | float,
    global_valid_toks: torch.Tensor | float,
    tp_group: ProcessGroup | None = None,
    *,
    dp_group: ProcessGroup | None = None,
    layout: TokenLayout | None = None,
    chunk_size: int | None = None,
    temperature: float = 1.0,
    sequence_parallel: bool = False,
    single_pass: bool | None = None,
    backend: str = "auto",
    grad_weight_out: torch.Tensor | None = None,
    grad_weight_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """``loss_fn`` on the log-probs of ``target`` under ``softmax(hidden @ weight.T / temperature)``, chunked.

    Args:
        loss_fn: the configured :class:`ClippedPGLoss`.
        hidden, weight, target, tp_group, chunk_size, temperature, sequence_parallel, backend, grad_weight_dtype: as
            :func:`~nemo_is_plugin.distributed.head.fused_linear.fused_linear_logprobs`.
        grad_weight_out: as there (the weight's gradient is added into it, ``weight.grad`` stays untouched). In the
            single pass the chunks accumulate into a dW-sized temporary (``grad_weight_dtype``) during the forward,
            added to ``grad_weight_out`` times the upstream gradient in the backward (one pass over V/TP x H).
        data, global_valid_seqs, global_valid_toks, layout: as ``ClippedPGLoss.__call__`` (``data`` is ``[B, S]``).
            With ``score_centering``, ``data['rollout_topk_ids']`` / ``['rollout_topk_logprobs']`` ``[B, S, k]`` (the
            sampler's head, sliced like the log-probs): the head's log-probs come from the label's chunk and lse
            (``kernels/head_ids.py``; ``curr_topk_logprobs`` is computed here), and the single pass takes the term's
            ``dL/d(head log-probs)`` chunk by chunk (``separable.TokenLossGradient``).
        dp_group: the DP ranks a batch statistic (an objective's) is reduced over; None: this call's batch.
        single_pass: None = whenever the config and layout allow it (``separable.single_pass_blocker``); True =
            require it (ValueError with the reason otherwise); False = always the two-pass schedule.

    Returns:
        ``(loss, metrics)`` exactly as ``loss_fn(fused_linear_logprobs(...), data, ...)``; the loss is
        differentiable w.r.t. ``hidden`` and ``weight``.
    """
    check_grad_weight_out(weight, grad_weight_out)
    # shape and dtype only: the log-probs' dtype (fp64 for fp64 inputs, else fp32) sets the dL/dc arithmetic's
    placeholder = torch.zeros(target.shape, dtype=acc_dtype(compute_dtype(hidden)), device=hidden.device)
    data = _with_head_placeholder(loss_fn, data, placeholder)
    prepared = PreparedInputs.of(loss_fn, placeholder, data, global_valid_seqs, global_valid_toks, layout)
    inputs, layout = prepared.inputs, prepared.layout
    # score centering: the sampler's head ids of each next-token position ([B, T, k], sliced like the log-probs)
    head_ids = inputs.head.head_ids if loss_fn.config.score_centering and inputs.head is not None else None
    layout = with_data_parallel(layout, dp_group)
    if not _runs_single_pass(loss_fn, layout, single_pass, hidden, weight):
        lp = fused_linear_logprobs(
            hidden,
            weight,
            target,
            tp_group,
            chunk_size=chunk_size,
            temperature=temperature,
            sequence_parallel=sequence_parallel,
            backend=backend,
            grad_weight_out=grad_weight_out,
            grad_weight_dtype=grad_weight_dtype,
            head_ids=head_ids,
        )
        if head_ids is not None:
            lp, trainer_head = lp
            data = {**data, TRAINER_HEAD_KEY: trainer_head}
        return loss_fn(lp, data, global_valid_seqs, global_valid_toks, layout=layout)  # validates lp's values too

    if sequence_parallel:
        hidden = all_gather(hidden, tp_group, dim=0)  # its backward reduce-scatters dX: no all-reduce inside
    chunk = check_lm_head_call(hidden, weight, target, temperature, chunk_size, backend=backend)
    opts = HeadOptions(
        tp_group, chunk, 1.0 / temperature, backend, not sequence_parallel, grad_weight_dtype, grad_weight_out
    )
    prepared = dataclasses.replace(prepared, layout=layout)
    return _single_pass_loss(loss_fn, prepared, hidden, weight, target, head_ids, opts)


def _runs_single_pass(
    loss_fn: ClippedPGLoss | CompiledLoss,
    layout: TokenLayout,
    single_pass: bool | None,
    hidden: torch.Tensor,
    weight: torch.Tensor,
) -> bool:
    """Whether the single pass runs: the config and layout allow it (``separable.single_pass_blocker``; with
    ``single_pass=True`` a ValueError with the reason otherwise), it is not turned off, and a gradient is wanted."""
    why = single_pass_blocker(loss_fn.config, layout)
    if single_pass and why is not None:
        raise ValueError(f"single_pass=True is not possible here: {why}; pass single_pass=None (auto) or False")
    wants_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    return why is None and single_pass is not False and wants_grad


def _single_pass_loss(
    loss_fn: ClippedPGLoss | CompiledLoss,
    prepared: PreparedInputs,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    head_ids: torch.Tensor | None,
    opts: HeadOptions,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """The single pass: each chunk's ``dL/dc`` (and ``dL/dc_head``) from :func:`chunk_step`; the loss value and the
    metrics from the loss on the final log-probs. With a :class:`CompiledLoss` (on a layout it compiles) the batch
    constants, each chunk's step and the loss with its metrics are its compiled graphs, and the inputs' checks are
    read with the metrics (one host read per call); else :meth:`ClippedPGLoss.compute`, with the IS correction the
    gradient was built with."""
    inputs, layout = prepared.inputs, prepared.layout
    compiled = loss_fn if isinstance(loss_fn, CompiledLoss) and loss_fn.compiles(layout) else None
    if compiled is not None:
        inputs = compiled.with_count_tensors(inputs)
        token_grad = compiled.token_gradient(inputs, layout)
        step = loss_gradient_step(token_grad, compiled.compiled_function(chunk_step))
        opts = dataclasses.replace(opts, compile_torch=compiled.compiled_function)  # the torch backend's passes
    else:
        prepared.read_checks()
        token_grad = TokenLossGradient.build(loss_fn, inputs, layout)  # type: ignore[arg-type]
        step = loss_gradient_step(token_grad)
    metrics: dict[str, Any] = {}

    def finish(logprob: torch.Tensor, trainer_head: torch.Tensor | None) -> torch.Tensor:
        head = inputs.head
        if trainer_head is not None and head is not None:
            head = dataclasses.replace(head, trainer_head=trainer_head)
        done = dataclasses.replace(inputs, curr_logprobs=logprob, head=head)
        if compiled is not None:
            loss, m = compiled.compute_unread(done, layout, prepared.pending)
        else:
            loss, m = loss_fn.compute(done, layout, is_correction=token_grad.correction)
        metrics.update(m)
        return loss.detach()

    read_upstream = compiled is None
    loss = _SinglePassFusedLoss.apply(hidden, weight, target, head_ids, step, finish, opts, read_upstream)
    return loss, metrics


__all__ = ["fused_linear_pg_loss"]
