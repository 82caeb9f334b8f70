"""The plugin's extrema as NeMo-RL's training step reduces its metrics: named for what it makes of them.

NeMo-RL (NVIDIA-NeMo/RL @7ea279ab) reduces a step's metrics in two places. Its policy workers
(``nemo_rl/models/policy/workers/dtensor_policy_worker.py``, ``train``) keep every loss call's metrics and divide each
key without ``_min`` / ``_max`` in its name by the number of global batches; ``Policy.train`` concatenates the DP
ranks' lists; ``grpo_train`` (``nemo_rl/algorithms/grpo.py``, after ``metrics.update(train_results["all_mb_metrics"])``)
takes the min / max of NeMo-RL's own four extrema (``probs_ratio{,_clamped}_{min,max}``) and the **sum** over every
loss call of the step (micro-batches x DP ranks) of every other key. The plugin's other extrema (``is_weight_min``,
``m2po_clip_high_max``, ...) would be summed there: a number with no meaning, under an extremum's name.

So the NeMo-RL adapter reports each of them as the call's extremum times the call's share of the step's valid
sequences (its valid sequences over ``global_valid_seqs``), named ``<stem>/min_mb_mean`` / ``<stem>/max_mb_mean``:
NeMo-RL's sum then gives the mean over the step's loss calls of each call's extremum, weighted by their sequences
(with one global batch per step, GRPO's usual setting). M2PO's bounds, which are one value per call, become the mean
bound the step applied. A call with no valid sequence adds 0. The suffixes ``/min_mb_mean`` / ``/max_mb_mean`` hold
neither ``_min`` nor ``_max``, so the worker divides these metrics by the number of global batches like every additive
metric -- unless the stem holds one: a rejection rule on a ``seq_max_*`` statistic (``is_rejection_sequence_max_k3_*``),
whose every metric, additive ones included, NeMo-RL then leaves undivided (the same with one global batch per step).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from nemo_is_plugin.loss.layout import TokenLayout

# The extrema NeMo-RL's grpo_train reduces with min / max (nemo_rl/algorithms/grpo.py @7ea279ab): kept as they are.
NEMO_RL_EXTREMA = frozenset(
    ("probs_ratio_min", "probs_ratio_max", "probs_ratio_clamped_min", "probs_ratio_clamped_max")
)
# The extra metric the adapter reads with the loss's own (same host read): the call's share of the valid sequences.
SEQUENCE_SHARE = "_nemo_rl_sequence_share"


def is_summed_extremum(name: str) -> bool:
    """An extremum of the plugin's that NeMo-RL's step would sum."""
    return name.endswith(("_min", "_max")) and name not in NEMO_RL_EXTREMA


def micro_batch_mean_name(name: str) -> str:
    """``is_weight_min`` -> ``is_weight/min_mb_mean``: the sequence-weighted mean over the step's loss calls."""
    stem, kind = name[:-4], name[-3:]
    return f"{stem}/{kind}_mb_mean"


def for_nemo_rl_step(metrics: Mapping[str, float], share: float) -> dict[str, float]:
    """The call's metrics with every summed extremum replaced by its share-weighted ``/..._mb_mean`` form (0 when the
    call has no valid sequence: its extrema are then +-inf)."""
    out: dict[str, float] = {}
    for name, value in metrics.items():
        if is_summed_extremum(name):
            out[micro_batch_mean_name(name)] = value * share if share > 0 else 0.0
        else:
            out[name] = value
    return out


def sequence_share(sample_mask: torch.Tensor, global_valid_seqs: Any, layout: TokenLayout) -> torch.Tensor:
    """The call's share of the step's valid sequences, a 0-d float64 device tensor (no host read): this process's
    part of its valid sequences over ``global_valid_seqs``, 0 when that is not positive. Passed as an extra metric sum,
    it is reduced over CP with the loss's metrics and read in their single host synchronisation."""
    mine = layout.replicated_share(sample_mask.double().sum())
    seqs = torch.as_tensor(global_valid_seqs, dtype=torch.float64, device=mine.device)
    return torch.where(seqs > 0, mine / seqs, torch.zeros_like(mine))


def renamed_normalizations(denominators: Mapping[str, str]) -> dict[str, str]:
    """The metric -> normaliser table under the names :func:`for_nemo_rl_step` gives: a share-weighted extremum is
    divided by the global sequence count (the split API calls with a count of 1 and rescales by ``sequences``)."""
    return {
        (micro_batch_mean_name(k) if is_summed_extremum(k) else k): ("sequences" if is_summed_extremum(k) else v)
        for k, v in denominators.items()
    }


__all__ = [
    "NEMO_RL_EXTREMA",
    "SEQUENCE_SHARE",
    "for_nemo_rl_step",
    "is_summed_extremum",
    "micro_batch_mean_name",
    "renamed_normalizations",
    "sequence_share",
]
