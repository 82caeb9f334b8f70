"""Which process groups the loss reduces over: tensor (vocab), context (sequence), data, and the pipeline stage.

A group of ``None`` means "no reduction" (a group of one), never "the global group": the plugin never reaches for
``torch.distributed``'s default group or megatron's globals behind the caller's back. ``from_parallel_state()`` is the
one place that reads megatron-core's ``parallel_state``, and only when the caller asks for it. megatron-core is an
extra (``megatron``): without it, asking for its groups is a one-line error naming the extra.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

from nemo_is_plugin.common.extras import require_extra

ProcessGroup = dist.ProcessGroup


def group_size(group: ProcessGroup | None) -> int:
    """World size of ``group``; 1 for ``None``."""
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: ProcessGroup | None) -> int:
    """This process's rank inside ``group``; 0 for ``None``."""
    return 0 if group is None else dist.get_rank(group)


def effective(group: ProcessGroup | None) -> ProcessGroup | None:
    """``group`` if it has more than one member, else ``None``: a group of one needs no communication."""
    return group if group is not None and dist.get_world_size(group) > 1 else None


def collective_device(group: ProcessGroup) -> torch.device:
    """Where a tensor of host values must live for a collective over ``group``: NCCL reduces only CUDA tensors (the
    current device), gloo and MPI host tensors."""
    if dist.get_backend(group) == dist.Backend.NCCL:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@dataclass(frozen=True)
class ParallelGroups:
    """The groups the loss needs.

    Attributes:
        tp: tensor-parallel group; the vocab dimension of the logits is sharded over it.
        cp: context-parallel group; the sequence dimension is sharded over it.
        dp: data-parallel group WITHOUT the CP ranks (megatron's ``get_data_parallel_group()``): the ranks holding
            different micro-batches, over which global counts and metrics are summed.
        pp: pipeline-parallel group, used only to broadcast metrics from the last stage.
        pp_is_last: whether this rank is on the last pipeline stage (the only one that computes the loss).
        pp_last_rank: the global rank of the last stage in this rank's ``pp`` group (broadcast source).
    """

    tp: ProcessGroup | None = None
    cp: ProcessGroup | None = None
    dp: ProcessGroup | None = None
    pp: ProcessGroup | None = None
    pp_is_last: bool = True
    pp_last_rank: int = 0

    @property
    def tp_size(self) -> int:
        return group_size(self.tp)

    @property
    def tp_rank(self) -> int:
        return group_rank(self.tp)

    @property
    def cp_size(self) -> int:
        return group_size(self.cp)

    @property
    def cp_rank(self) -> int:
        return group_rank(self.cp)

    @property
    def dp_size(self) -> int:
        return group_size(self.dp)

    @classmethod
    def from_parallel_state(cls) -> ParallelGroups:
        """Read megatron-core's ``parallel_state`` groups (gloo or NCCL); all ``None`` when it is not initialised.

        Groups of size one are returned as ``None`` so that no collective runs for them. Without megatron-core
        installed: :class:`~nemo_is_plugin.common.extras.MissingExtraError` (an ImportError) naming the ``megatron``
        extra.
        """
        # Not imported yet means nobody initialised it; importing megatron.core costs seconds, so don't.
        ps = sys.modules.get("megatron.core.parallel_state")
        if ps is None:
            require_extra("megatron", "groups='parallel_state' (megatron-core's parallel_state groups)")
            return cls()
        if not ps.model_parallel_is_initialized():
            return cls()
        return cls(
            tp=effective(ps.get_tensor_model_parallel_group()),
            cp=effective(ps.get_context_parallel_group()),
            dp=effective(ps.get_data_parallel_group(with_context_parallel=False)),
            pp=effective(ps.get_pipeline_model_parallel_group()),
            pp_is_last=ps.is_pipeline_last_stage(ignore_virtual=True),
            pp_last_rank=ps.get_pipeline_model_parallel_last_rank(),
        )
