"""Pipeline parallelism: the loss runs on the last stage only; the other stages get its metrics by broadcast."""

from __future__ import annotations

import torch.distributed as dist

from nemo_is_plugin.distributed.parallel.groups import ParallelGroups


def broadcast_metrics_from_last_stage(metrics: dict[str, float] | None, groups: ParallelGroups) -> dict[str, float]:
    """Every pipeline stage returns the last stage's ``metrics`` (a ``{name: float}`` dict, None elsewhere).

    One ``broadcast_object_list`` over ``groups.pp`` from ``groups.pp_last_rank``; the other stages do not know the
    metric names in advance, hence an object broadcast. With no pipeline group the metrics are returned as they are.
    """
    if groups.pp is None:
        if metrics is None:
            raise ValueError("no pipeline group and no metrics: this rank must be the last stage")
        return dict(metrics)
    box: list[dict[str, float] | None] = [None]
    if groups.pp_is_last:
        if metrics is None:
            raise ValueError("the last pipeline stage must pass the metrics it computed")
        box[0] = dict(metrics)
    dist.broadcast_object_list(box, src=groups.pp_last_rank, group=groups.pp)
    if box[0] is None:
        raise RuntimeError(f"the broadcast from pipeline rank {groups.pp_last_rank} delivered no metrics")
    return box[0]
