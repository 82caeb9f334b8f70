"""Top-k / top-p filtered next-token log-probs from hidden states, with the unfiltered ones from the same GEMMs.

NeMo-RL trains with the rollout engine's top-k / top-p filter applied to the training logits (its
``TrainingSamplingParams``; ``nemo_rl/algorithms/logits_sampling_utils.py`` @7ea279ab, after vLLM's sampler): per
token, with ``z`` the temperature-scaled logits over the whole vocabulary,

- top-k: keep ``z_v >= `` the k-th largest ``z`` (ties at the threshold kept);
- top-p (after top-k): sort the kept logits ascending, ``softmax`` them, keep where the cumulative sum exceeds
  ``1 - p``, and always the largest;
- the filtered log-prob is ``z_y - logsumexp(kept z)`` when the target is kept, ``-inf`` otherwise; its gradient
  treats the mask as constant: ``g (onehot - p_filtered)`` on the kept entries, 0 elsewhere.

The actor loss reads the filtered log-probs, the KL penalty the unfiltered ones (NeMo-RL's
``curr_logprobs_unfiltered``); both come out of one pass here. The filter needs each token's whole row of logits, so
per chunk of tokens the TP ranks all-gather their ``[n, V/TP]`` logits into ``[n, V]`` (the memory of the chunk times
TP; chunks are sized for it by ``FILTER_CHUNK_BYTES``), and top-p sorts the row, as NeMo-RL does. The backward
recomputes each chunk (no ``[N, V]`` tensor is kept): 4 GEMMs, torch only. With neither filter this module is not
needed: :func:`~nemo_is_plugin.distributed.head.fused_linear.fused_linear_logprobs` is the fast path.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from nemo_is_plugin.distributed.parallel.collectives import all_reduce_sum
from nemo_is_plugin.distributed.parallel.groups import ProcessGroup, group_rank, group_size
from nemo_is_plugin.kernels.gemm import acc_dtype, compute_dtype

FILTER_CHUNK_BYTES = 256 * 2**20  # per chunk: the gathered fp32 row block and top-p's sort buffers (~24 B / entry)


def filtering(top_k: int | None, top_p: float | None) -> bool:
    """Whether NeMo-RL would filter: a positive top-k, or a top-p other than 1."""
    return (top_k is not None and top_k > 0) or (top_p is not None and top_p != 1.0)


def keep_mask(z: torch.Tensor, top_k: int | None, top_p: float | None) -> torch.Tensor:
    """Bool ``[n, V]``: the entries of the rows of ``z`` the top-k / top-p filter keeps (module docstring)."""
    keep = torch.ones_like(z, dtype=torch.bool)
    if top_k is not None and top_k > 0:
        kth = torch.topk(z, min(top_k, z.shape[-1]), dim=-1).values[..., -1:]
        keep = z >= kth
    if top_p is None or top_p == 1.0:
        return keep
    ascending, order = torch.where(keep, z, float("-inf")).sort(dim=-1)
    cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)
    nucleus = cumulative > 1 - top_p
    nucleus[..., -1] = True
    return keep & torch.empty_like(nucleus).scatter_(-1, order, nucleus)


def _gather_vocab(z: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    if group_size(group) == 1:
        return z
    parts = [torch.empty_like(z) for _ in range(group_size(group))]
    dist.all_gather(parts, z.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


class _FilteredLogprobs(torch.autograd.Function):
    @staticmethod
    def _chunk(ctx_or_opts, x_c, w, target_c):
        group, inv_t, top_k, top_p = ctx_or_opts
        z = torch.mm(x_c, w.t()).to(acc_dtype(x_c.dtype)) * inv_t
        full = _gather_vocab(z, group)
        keep = keep_mask(full, top_k, top_p)
        return full, keep, target_c.clamp(0, full.shape[-1] - 1)

    @staticmethod
    def forward(ctx, hidden, weight, target, opts, chunk, reduce_grad_hidden):
        x, dtype = hidden.reshape(-1, hidden.shape[-1]), compute_dtype(hidden)
        w, t = weight.to(dtype), target.reshape(-1)
        out = torch.empty(2, x.shape[0], dtype=acc_dtype(dtype), device=x.device)
        for c0 in range(0, x.shape[0], chunk):
            full, keep, y = _FilteredLogprobs._chunk(opts, x[c0 : c0 + chunk].to(dtype), w, t[c0 : c0 + chunk])
            z_y = full.gather(-1, y[:, None]).squeeze(-1)
            kept_y = keep.gather(-1, y[:, None]).squeeze(-1)
            lse_f = torch.where(keep, full, float("-inf")).logsumexp(dim=-1)
            out[0, c0 : c0 + chunk] = torch.where(kept_y, z_y - lse_f, float("-inf"))
            out[1, c0 : c0 + chunk] = z_y - full.logsumexp(dim=-1)
        ctx.save_for_backward(hidden, weight, target)
        ctx.opts, ctx.chunk, ctx.reduce = opts, chunk, reduce_grad_hidden
        return out[0].reshape(target.shape), out[1].reshape(target.shape)

    @staticmethod
    def backward(ctx, g_filtered, g_unfiltered):
        hidden, weight, target = ctx.saved_tensors
        group, inv_t = ctx.opts[0], ctx.opts[1]
        x, dtype = hidden.reshape(-1, hidden.shape[-1]), compute_dtype(hidden)
        w, t = weight.to(dtype), target.reshape(-1)
        g = [torch.zeros(t.shape, device=x.device) if v is None else v.reshape(-1) for v in (g_filtered, g_unfiltered)]
        vocab, start = weight.shape[0], group_rank(group) * weight.shape[0]
        dx = torch.empty(x.shape, dtype=acc_dtype(dtype), device=x.device)
        dw = torch.zeros(weight.shape, dtype=acc_dtype(dtype), device=x.device)
        for c0 in range(0, x.shape[0], ctx.chunk):
            x_c = x[c0 : c0 + ctx.chunk].to(dtype)
            full, keep, y = _FilteredLogprobs._chunk(ctx.opts, x_c, w, t[c0 : c0 + ctx.chunk])
            onehot = torch.zeros_like(full).scatter_(-1, y[:, None], 1.0)
            p_f = torch.where(keep, full, float("-inf")).softmax(dim=-1)
            g_f, g_u = (v[c0 : c0 + ctx.chunk, None].to(full.dtype) for v in g)
            d = torch.where(keep, g_f * (onehot - p_f), 0.0) + g_u * (onehot - full.softmax(dim=-1))
            d_local = (d[:, start : start + vocab] * inv_t).to(dtype)
            dx[c0 : c0 + ctx.chunk] = torch.mm(d_local, w)
            dw += torch.mm(d_local.t(), x_c).to(dw.dtype)
        if ctx.reduce:
            dx = all_reduce_sum(dx, group)
        return dx.to(hidden.dtype).reshape(hidden.shape), dw.to(weight.dtype), None, None, None, None


def filtered_linear_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    tp_group: ProcessGroup | None = None,
    *,
    top_k: int | None = None,
    top_p: float | None = None,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    reduce_grad_hidden: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(filtered, unfiltered)`` log-probs of ``target`` under ``softmax(hidden W^T / temperature)``, the filter as
    NeMo-RL's (module docstring). ``hidden [..., H]`` replicated over TP (gather sequence-parallel rows first),
    ``weight [V/TP, H]`` this rank's rows, ``target [...]`` global ids. dX is summed over TP unless
    ``reduce_grad_hidden=False`` (the caller's gather sums it)."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    full_vocab = weight.shape[0] * group_size(tp_group)
    chunk = chunk_size or max(1, FILTER_CHUNK_BYTES // (24 * full_vocab))
    opts = (tp_group, 1.0 / temperature, top_k, top_p)
    return _FilteredLogprobs.apply(hidden, weight, target, opts, chunk, reduce_grad_hidden)


__all__ = ["FILTER_CHUNK_BYTES", "filtered_linear_logprobs", "filtering", "keep_mask"]
