"""Distributed: the loss and the LM head under tensor, context, data and pipeline parallelism, in three packages:

- ``parallel``: the plumbing (no loss math, no head): process groups, autograd-aware collectives, CP sharding and the
  CP TokenLayout, DP counts and metrics, the PP metric broadcast;
- ``head``: the LM-head ops: chunked vocab-parallel log-probs from logits or from hidden states and the weight shard,
  under a Megatron decoder's sequence-first output, NeMo-RL's top-k / top-p filter;
- ``entry_points``: the loss's parallel entry points (the LOGIT loss, the fused hidden-state loss).

Re-exports the plumbing's names and ``vocab_parallel_logprobs`` only; the entry points are not imported here (they pull
in the loss): import them from ``nemo_is_plugin.distributed.entry_points.logit_loss`` / ``.fused_linear_loss``.
"""

from nemo_is_plugin.distributed.head.vocab_parallel import vocab_parallel_logprobs
from nemo_is_plugin.distributed.parallel.collectives import all_gather, all_reduce_max, all_reduce_min, all_reduce_sum
from nemo_is_plugin.distributed.parallel.context_parallel import (
    CPTokenLayout,
    cp_layout,
    cp_layout_packed,
    cp_layout_padded,
)
from nemo_is_plugin.distributed.parallel.cp_sharding import (
    CP_ORDERS,
    gather_packed,
    gather_padded,
    local_cu_seqlens,
    shard_packed,
    shard_padded,
)
from nemo_is_plugin.distributed.parallel.data_parallel import all_reduce_metrics, combine_metrics, global_valid_counts
from nemo_is_plugin.distributed.parallel.groups import ParallelGroups
from nemo_is_plugin.distributed.parallel.pipeline import broadcast_metrics_from_last_stage

__all__ = [
    "CPTokenLayout",
    "CP_ORDERS",
    "ParallelGroups",
    "all_gather",
    "all_reduce_max",
    "all_reduce_metrics",
    "all_reduce_min",
    "all_reduce_sum",
    "broadcast_metrics_from_last_stage",
    "combine_metrics",
    "cp_layout",
    "cp_layout_packed",
    "cp_layout_padded",
    "gather_packed",
    "gather_padded",
    "global_valid_counts",
    "local_cu_seqlens",
    "shard_packed",
    "shard_padded",
    "vocab_parallel_logprobs",
]
