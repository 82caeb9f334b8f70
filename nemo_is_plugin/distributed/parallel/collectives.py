"""Autograd-aware collectives over an explicit process group (``None`` = a group of one: identity, no communication).

Semantics of the gradients. Under TP/CP every rank of the group evaluates its *own* loss term ``L_r``; the quantity
being differentiated is the sum ``L = sum_r L_r`` (which is what the per-rank backward passes compute together).

- ``all_reduce_sum(x)``: every rank gets ``s = sum_r x_r`` and may use it in its own ``L_r``. Then
  ``dL/dx_r = sum_k dL_k/ds``, so the backward is again an all-reduce SUM of the incoming gradients.
- ``all_gather(x)``: every rank gets ``[x_0, ..., x_{n-1}]``; ``dL/dx_r = sum_k dL_k/d(slice r)``: an all-reduce SUM of
  the incoming gradients, then the own slice (a reduce-scatter, written as all-reduce + narrow because gloo has no
  reduce_scatter).
- ``all_reduce_max`` / ``all_reduce_min``: no gradient (they feed masks and metrics only).

Every rank of the group must call the same collectives in the same order, forward and backward.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from nemo_is_plugin.distributed.parallel.groups import ProcessGroup, group_rank, group_size


def _is_trivial(group: ProcessGroup | None) -> bool:
    return group is None or dist.get_world_size(group) == 1


# forward and setup_context apart: the form torch.func transforms (vjp) accept, so that a loss reduced over CP or DP
# ranks can be differentiated by torch.func as by autograd (separable.aggregation_weights)
class _AllReduceSum(torch.autograd.Function):
    @staticmethod
    def forward(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        out = x.contiguous().clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
        return out

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        ctx.group = inputs[1]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)
        return grad, None


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(x: torch.Tensor, group: ProcessGroup, dim: int) -> torch.Tensor:
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x, group=group)
        return torch.cat(parts, dim=dim)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        x, ctx.group, ctx.dim = inputs
        ctx.length = x.shape[ctx.dim]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)
        own = grad.narrow(ctx.dim, dist.get_rank(ctx.group) * ctx.length, ctx.length)
        return own.contiguous(), None, None


def all_reduce_sum(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Sum of ``x`` over ``group``, differentiable (backward: all-reduce SUM of the gradients). Identity for None."""
    if _is_trivial(group):
        return x
    return _AllReduceSum.apply(x, group)


def all_gather(x: torch.Tensor, group: ProcessGroup | None, dim: int = 0) -> torch.Tensor:
    """Concatenate the (equal-shaped) ``x`` of every rank along ``dim`` in rank order, differentiable.

    Shapes: ``x [..., n, ...]`` -> ``[..., size * n, ...]``. Identity for None.
    """
    if _is_trivial(group):
        return x
    dim = dim % x.dim()
    return _AllGather.apply(x, group, dim)


def _reduce_no_grad(x: torch.Tensor, group: ProcessGroup | None, op) -> torch.Tensor:
    if _is_trivial(group):
        return x.detach()
    out = x.detach().contiguous().clone()
    dist.all_reduce(out, op=op, group=group)
    return out


def all_reduce_max(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Elementwise max over ``group`` (no gradient). Identity (detached) for None."""
    return _reduce_no_grad(x, group, dist.ReduceOp.MAX)


def all_reduce_min(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Elementwise min over ``group`` (no gradient). Identity (detached) for None."""
    return _reduce_no_grad(x, group, dist.ReduceOp.MIN)


__all__ = ["all_gather", "all_reduce_max", "all_reduce_min", "all_reduce_sum", "group_rank", "group_size"]
