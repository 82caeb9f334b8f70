"""A NeMo-RL-style driver: ``grpo_train``'s data flow around one loss function, on CPU with gloo.

What it reproduces (NeMo-RL ``grpo_train`` -> ``policy.train`` -> worker ``train``):

1. the global batch ``[B, S]`` is sharded by contiguous rows over the DP ranks (``shard_by_batch_size``);
2. each rank counts its valid sequences (``sum sample_mask``) and tokens (``sum token_mask[:, 1:] * sample_mask``)
   and all-reduces both over the DP group: the *global* counts every loss call divides by;
3. each rank splits its shard into micro-batches, calls the loss once per micro-batch and back-propagates each loss
   (gradient accumulation);
4. the per-micro-batch metrics of all ranks are gathered and reduced by the driver as ``grpo_train`` does
   (nemo_rl/algorithms/grpo.py @7ea279ab): NeMo-RL's four extrema ``probs_ratio{,_clamped}_{min,max}`` with min /
   max, every other key summed; the step's loss is the sum of the micro-batch losses.

Two alternative call patterns of NeMo-RL are emulated per micro-batch:

- ``packed``: ``SequencePackingLossWrapper``: one call per sequence on its unpadded slice, losses and metrics summed;
- ``split``: the split API: every call gets ``global_valid_seqs = global_valid_toks = 1``; after the step the loss and
  the gradient are divided by the ``loss_type``'s global count and each metric by the count its
  ``metric_normalizations`` entry names (metrics not listed: the ``loss_type``'s count; NONE: unscaled).

``run_dp(scenarios, world_size)`` spawns ``world_size`` gloo processes once and runs every scenario in them.
"""

from __future__ import annotations

import math
import os
import tempfile
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _ranks import gather_objects
from helpers.gloo import init_gloo  # imports torch.distributed.nn.functional before any process group (see there)

from nemo_is_plugin.adapters.nemo_rl.step_metrics import NEMO_RL_EXTREMA

MODES = ("direct", "packed", "split")


@dataclass
class Scenario:
    """One training step to drive. ``data`` holds NeMo-RL's ``[B, S]`` tensors; ``logprobs`` is ``[B, S-1]``."""

    name: str
    loss_fn: Any
    data: dict[str, torch.Tensor]
    logprobs: torch.Tensor
    mode: str = "direct"
    micro_batch_size: int = 2


@dataclass
class StepResult:
    """What the driver saw: summed loss, the gradient w.r.t. the full-batch ``logprobs`` and the reduced metrics."""

    loss: float
    grad: torch.Tensor
    metrics: dict[str, float]
    global_valid_seqs: float
    global_valid_toks: float
    calls: int = 0
    per_rank_calls: list[int] = field(default_factory=list)


# ----------------------------------------------------------------------------------------------- helpers


def rows(data: dict[str, torch.Tensor], start: int, stop: int) -> dict[str, torch.Tensor]:
    return {k: v[start:stop] for k, v in data.items()}


def local_counts(data: dict[str, torch.Tensor]) -> torch.Tensor:
    """``[seqs, toks]`` float64: NeMo-RL's normalisers before the DP all-reduce."""
    sm = data["sample_mask"].double()
    toks = (data["token_mask"][:, 1:].double() * sm[:, None]).sum()
    return torch.stack([sm.sum(), toks])


def reduce_metrics(per_call: list[dict[str, float]]) -> dict[str, float]:
    """Sum every metric over calls; NeMo-RL's four extrema with min / max (grpo_train's reduction)."""
    out: dict[str, float] = {}
    for metrics in per_call:
        for k, v in metrics.items():
            v = float(v)
            if k not in out:
                out[k] = v
            elif k in NEMO_RL_EXTREMA and k.endswith("_min"):
                out[k] = min(out[k], v)
            elif k in NEMO_RL_EXTREMA:
                out[k] = max(out[k], v)
            else:
                out[k] += v
    return out


def unpadded_length(token_mask_row: torch.Tensor) -> int:
    """Length of a right-padded sequence: up to its last unmasked token (at least 2, one prediction)."""
    nz = torch.nonzero(token_mask_row != 0)
    return max(int(nz.max()) + 1 if nz.numel() else 2, 2)


def _is_token_level(loss_fn: Any) -> bool:
    return str(getattr(loss_fn.loss_type, "value", loss_fn.loss_type)) == "token_level"


def _call(loss_fn, x, data, gvs, gvt):
    return loss_fn(next_token_logprobs=x, data=data, global_valid_seqs=gvs, global_valid_toks=gvt)


# ----------------------------------------------------------------------------------------------- one rank


def run_rank(sc: Scenario, dp_rank: int, dp_size: int, dp_group: dist.ProcessGroup | None) -> dict[str, Any]:
    """This rank's part of one step; returns its loss sum, gradient rows, per-call metrics and counts."""
    if sc.mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {sc.mode!r}")
    b = sc.logprobs.shape[0]
    if b % dp_size:
        raise ValueError(f"batch {b} does not split over {dp_size} DP ranks")
    per = b // dp_size
    shard = rows(sc.data, dp_rank * per, (dp_rank + 1) * per)
    x = sc.logprobs[dp_rank * per : (dp_rank + 1) * per].detach().clone().requires_grad_(True)

    counts = local_counts(shard)
    if dp_group is not None:
        dist.all_reduce(counts, group=dp_group)
    gvs, gvt = counts[0].float(), counts[1].float()
    one = torch.tensor(1.0)

    loss_sum, metrics, calls = 0.0, [], 0
    for start in range(0, per, sc.micro_batch_size):
        stop = min(start + sc.micro_batch_size, per)
        mb, x_mb = rows(shard, start, stop), x[start:stop]
        if sc.mode == "packed":
            for i in range(stop - start):
                n = unpadded_length(mb["token_mask"][i])
                seq = {k: (v[i : i + 1, :n] if v.dim() > 1 else v[i : i + 1]) for k, v in mb.items()}
                loss, m = _call(sc.loss_fn, x_mb[i : i + 1, : n - 1], seq, gvs, gvt)
                loss.backward()
                loss_sum, calls = loss_sum + loss.item(), calls + 1
                metrics.append(m)
        else:
            split = sc.mode == "split"
            loss, m = _call(sc.loss_fn, x_mb, mb, one if split else gvs, one if split else gvt)
            loss.backward()
            loss_sum, calls = loss_sum + loss.item(), calls + 1
            metrics.append(m)
    grad = x.grad if x.grad is not None else torch.zeros_like(x)
    return {"loss": loss_sum, "grad": grad.detach(), "metrics": metrics, "counts": counts, "calls": calls}


def finish_step(sc: Scenario, parts: list[dict[str, Any]]) -> StepResult:
    """The driver's reduction over ranks (in rank order), plus the split API's rescale."""
    counts = parts[0]["counts"]
    gvs, gvt = float(counts[0]), float(counts[1])
    loss = sum(p["loss"] for p in parts)
    grad = torch.cat([p["grad"] for p in parts])
    metrics = reduce_metrics([m for p in parts for m in p["metrics"]])
    if sc.mode == "split":
        n_grad = gvt if _is_token_level(sc.loss_fn) else gvs
        inv = {"tokens": 1.0 / gvt, "sequences": 1.0 / gvs, "none": 1.0}
        norms = getattr(sc.loss_fn, "metric_normalizations", {})
        loss, grad = loss / n_grad, grad / n_grad
        metrics = {k: v * (inv[str(norms[k].value)] if k in norms else 1.0 / n_grad) for k, v in metrics.items()}
    return StepResult(loss, grad, metrics, gvs, gvt, sum(p["calls"] for p in parts), [p["calls"] for p in parts])


# ----------------------------------------------------------------------------------------------- processes


def _worker(rank: int, world_size: int, store: str, scenarios: list[Scenario], out_path: str) -> None:
    torch.set_num_threads(1)
    init_gloo(rank, world_size, f"file://{store}")
    try:
        group = dist.new_group(list(range(world_size)), backend="gloo")  # explicit DP group, never the default one
        results = []
        for sc in scenarios:
            part = run_rank(sc, rank, world_size, group)
            gathered = gather_objects(part, group)
            if rank == 0:
                results.append((sc.name, finish_step(sc, gathered)))
        if rank == 0:
            torch.save(dict(results), out_path)
    finally:
        dist.destroy_process_group()


def run_dp(scenarios: list[Scenario], world_size: int = 2) -> dict[str, StepResult]:
    """Run every scenario as one step on ``world_size`` DP ranks (gloo processes, spawned once)."""
    with tempfile.TemporaryDirectory() as tmp:
        store, out = os.path.join(tmp, "store"), os.path.join(tmp, "results.pt")
        mp.spawn(_worker, args=(world_size, store, scenarios, out), nprocs=world_size, join=True)
        return torch.load(out, weights_only=False)


def run_local(sc: Scenario) -> StepResult:
    """The same step on one process (DP = 1), for comparisons without spawning."""
    return finish_step(sc, [run_rank(sc, 0, 1, None)])


def isclose(a: float, b: float, rtol: float, atol: float) -> bool:
    if math.isinf(a) or math.isinf(b):
        return a == b
    return math.isclose(a, b, rel_tol=rtol, abs_tol=atol)
