"""What the host adapters share, each idea with one rule: who owns the rollout correction, how a host's process groups
are named and read, the error of a worker without a plugin config, the keys a config object carries, and metrics
rescaled to other counts.

The hosts differ in their words (NeMo-RL's ``loss_fn`` section, verl's ``policy_loss.nemo_is``, slime's ``args``) but
not in these rules; each adapter imports them from here (docs/design.md, *Adapters*).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel

from nemo_is_plugin.config import REJECTION_TYPES
from nemo_is_plugin.distributed.parallel.groups import ParallelGroups
from nemo_is_plugin.loss.config_model import ClippedPGLossConfig
from nemo_is_plugin.loss.denominator import Denominator
from nemo_is_plugin.loss.metrics import MetricValues

# ----------------------------------------------------------------------------------------- the rollout correction


def owns_correction(cfg: ClippedPGLossConfig) -> bool:
    """Whether the plugin computes an IS correction from the rollout log-probs log mu: its own IS weights, a rejection
    (a rejection truncation type or a rule) or the veto. Otherwise the host corrects, or nothing does.

    The other truncation types (tis, icepop, seq-mask-tis) need ``use_importance_sampling_correction`` (the config
    refuses them without it), so they are covered by the first test.
    """
    return (
        cfg.use_importance_sampling_correction
        or cfg.truncated_importance_sampling_type in REJECTION_TYPES
        or bool(cfg.rejection_rules)
        or cfg.importance_sampling_veto_threshold is not None
    )


def reads_rollout_logprobs(cfg: ClippedPGLossConfig) -> bool:
    """Whether the loss reads log mu at all: it owns the correction, or it runs in bypass mode
    (``old_policy_logprobs: generation``: pi_old is the rollout policy)."""
    return owns_correction(cfg) or cfg.bypasses_prev


# --------------------------------------------------------------------------------------------- process groups

PARALLEL_STATE = "parallel_state"  # groups sentinel: read megatron-core's groups inside the worker, at every call
GroupsSpec = None | str | ParallelGroups


def check_groups(groups: GroupsSpec, *, allow_none: bool) -> None:
    """Refuse a groups argument that is not ``PARALLEL_STATE``, a ``ParallelGroups`` or (``allow_none``: one process)
    None."""
    if groups == PARALLEL_STATE or isinstance(groups, ParallelGroups) or (allow_none and groups is None):
        return
    allowed = (
        f"None, a ParallelGroups or {PARALLEL_STATE!r}" if allow_none else f"{PARALLEL_STATE!r} or a ParallelGroups"
    )
    raise ValueError(f"groups must be {allowed}, got {groups!r}")


def resolve_groups(groups: GroupsSpec) -> ParallelGroups:
    """The groups of a call: explicit ones as given; ``PARALLEL_STATE``: megatron-core's ``parallel_state`` as it is
    now, read at every call (a few attribute reads) and never kept, since a process that destroys and rebuilds its
    groups (restarts, notebooks, tests) must not keep those of its first call (without megatron-core installed: an
    ImportError naming the ``megatron`` extra); None: one process, no communication."""
    if groups == PARALLEL_STATE:
        return ParallelGroups.from_parallel_state()
    return groups if isinstance(groups, ParallelGroups) else ParallelGroups()


# ------------------------------------------------------------------------------------------------ plugin config


class MissingPluginConfigError(RuntimeError):
    """An entry point found no plugin config on this worker: running the host's own loss instead would be silent."""


def given_keys(cfg: Any) -> dict[str, Any]:
    """The ``loss_fn`` keys a config object carries: the plugin's ``ClippedPGLossConfig`` or a host's pydantic config
    (NeMo-RL's ``ClippedPGLossConfig``): the keys it was given (extras included; unset keys are the defaults, which
    are the plugin's); a mapping as it is; None: no keys."""
    if cfg is None:
        return {}
    if isinstance(cfg, BaseModel):
        return cfg.model_dump(exclude_unset=True)
    if isinstance(cfg, Mapping):
        return dict(cfg)
    raise TypeError(
        f"cfg must be NeMo-RL's ClippedPGLossConfig, a loss_fn mapping or a plugin ClippedPGLossConfig, got "
        f"{type(cfg).__name__}"
    )


# ------------------------------------------------------------------------------------------------------ metrics


def renormalize(metrics: MetricValues, *, tokens: tuple[float, float], seqs: tuple[float, float]) -> dict[str, float]:
    """Change each metric's denominator from one count to another: ``tokens = (old, new)``, ``seqs = (old, new)``.

    Every additive metric is "a local sum / a global count" (docs/design.md, metrics contract), and each metric
    declares which count where the loss emits it (:class:`~nemo_is_plugin.loss.denominator.Denominator`). E.g. from the
    global counts the loss divided by to this micro-batch's own counts, for hosts (verl) that average per-micro-batch
    metrics instead of summing them. A new count of 0 gives 0 (the metric's sum is 0 then too).
    """
    factor = {
        Denominator.TOKENS: tokens[0] / tokens[1] if tokens[1] else 0.0,
        Denominator.SEQUENCES: seqs[0] / seqs[1] if seqs[1] else 0.0,
        Denominator.NONE: 1.0,
    }
    return {k: v * factor[metrics.denominators[k]] for k, v in metrics.items()}


__all__ = [
    "PARALLEL_STATE",
    "GroupsSpec",
    "MissingPluginConfigError",
    "check_groups",
    "given_keys",
    "owns_correction",
    "reads_rollout_logprobs",
    "renormalize",
    "resolve_groups",
]
