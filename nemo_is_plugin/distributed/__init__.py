"""Parallel plumbing for the loss (no loss math): process groups, autograd-aware collectives, CP sharding and the CP
TokenLayout, the chunked vocab-parallel log-prob kernel, PP / DP helpers, and the LOGIT entry point.

Re-exports only; see each module. ``logit_loss`` is not imported here (it pulls in the loss); import it directly.
"""

from nemo_is_plugin.distributed.collectives import all_gather, all_reduce_max, all_reduce_min, all_reduce_sum
from nemo_is_plugin.distributed.context_parallel import CPTokenLayout, cp_layout, cp_layout_packed, cp_layout_padded
from nemo_is_plugin.distributed.cp_sharding import (
    CP_ORDERS,
    gather_packed,
    gather_padded,
    local_cu_seqlens,
    shard_packed,
    shard_padded,
)
from nemo_is_plugin.distributed.data_parallel import all_reduce_metrics, combine_metrics, global_valid_counts
from nemo_is_plugin.distributed.groups import ParallelGroups
from nemo_is_plugin.distributed.pipeline import broadcast_metrics_from_last_stage
from nemo_is_plugin.distributed.vocab_parallel import vocab_parallel_logprobs

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
