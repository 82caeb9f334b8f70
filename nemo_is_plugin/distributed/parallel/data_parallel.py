"""Data parallelism: global normalisers, metric reduction and batch statistics across the ranks that hold different
micro-batches.

NeMo-RL's rules (NVIDIA-NeMo/RL at 7ea279abfbeb698b092856d0dab61e7cf39bc909: ``ClippedPGLossFn`` in
``nemo_rl/algorithms/loss/loss_functions.py``, the metric reduction of ``megatron_policy_worker.py``): the loss divides
local sums by GLOBAL counts, so losses and additive metrics simply add up across micro-batches and DP ranks; names
with ``_min`` / ``_max`` are reduced with min / max.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
import torch.distributed as dist

from nemo_is_plugin.distributed.parallel.collectives import all_reduce_max, all_reduce_sum
from nemo_is_plugin.distributed.parallel.groups import ProcessGroup, collective_device, group_size
from nemo_is_plugin.loss.layout import TokenLayout


class DataParallelBatch:
    """A batch statistic's partials reduced over the DP group (:class:`~nemo_is_plugin.loss.layout.BatchGroup`)."""

    def __init__(self, group: ProcessGroup):
        self.group = group

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        return all_reduce_sum(t, self.group)

    def max(self, t: torch.Tensor) -> torch.Tensor:
        return all_reduce_max(t, self.group)


def with_data_parallel(layout: TokenLayout, dp_group: ProcessGroup | None) -> TokenLayout:
    """``layout`` whose batch statistics (``TokenLayout.reduce_batch_sums`` / ``_max``: an objective's) span the DP
    group as well as its own CP group. ``dp_group`` None or of size one: ``layout`` itself (no reduction).

    Every DP rank must call the loss as many times, in the same order (one micro-batch each per call): the statistic
    is an all-reduce over the group."""
    if dp_group is None or group_size(dp_group) == 1:
        return layout
    return layout.with_batch_group(DataParallelBatch(dp_group))


def _is_min(name: str) -> bool:
    return name.endswith("_min")


def _is_max(name: str) -> bool:
    return name.endswith("_max")


def global_valid_counts(
    token_mask: torch.Tensor, sample_mask: torch.Tensor, dp_group: ProcessGroup | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """NeMo-RL's normalisers summed over ``dp_group``: (global_valid_seqs, global_valid_toks), float64 0-d.

    token_mask: [B, S] over the full (un-sharded) sequences; sample_mask: [B]. Tokens are counted on ``[:, 1:]``,
    aligned with next-token log-probs: ``sum(token_mask[:, 1:] * sample_mask[:, None])``.
    """
    sm = sample_mask.double()
    counts = torch.stack([sm.sum(), (token_mask[:, 1:].double() * sm.unsqueeze(-1)).sum()])
    if dp_group is not None:
        dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=dp_group)
    return counts[0], counts[1]


def combine_metrics(per_batch: Iterable[Mapping[str, float]]) -> dict[str, float]:
    """Combine the metrics of several micro-batches on one rank: sums, and min / max for ``_min`` / ``_max``."""
    out: dict[str, float] = {}
    for metrics in per_batch:
        for name, value in metrics.items():
            if name not in out:
                out[name] = float(value)
            elif _is_min(name):
                out[name] = min(out[name], float(value))
            elif _is_max(name):
                out[name] = max(out[name], float(value))
            else:
                out[name] += float(value)
    return out


def all_reduce_metrics(metrics: Mapping[str, float], dp_group: ProcessGroup | None) -> dict[str, float]:
    """Reduce one rank's metrics over ``dp_group`` (three collectives: SUM, MIN, MAX, in float64).

    Every rank must hold the same metric names (the loss emits a fixed set for a given config).
    """
    if dp_group is None:
        return dict(metrics)
    names = sorted(metrics)
    device = collective_device(dp_group)
    out: dict[str, float] = {}
    for op, pick in (
        (dist.ReduceOp.MIN, _is_min),
        (dist.ReduceOp.MAX, _is_max),
        (dist.ReduceOp.SUM, lambda n: not (_is_min(n) or _is_max(n))),
    ):
        chosen = [n for n in names if pick(n)]
        if not chosen:
            continue
        t = torch.tensor([float(metrics[n]) for n in chosen], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=op, group=dp_group)
        out.update(zip(chosen, t.tolist()))
    return out
