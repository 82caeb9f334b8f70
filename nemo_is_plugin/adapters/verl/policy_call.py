"""One call of the plugin's loss in verl's policy-loss registry, step by step (``VerlPolicyLoss.__call__`` reads them
top to bottom): the losses of one verl setting (:class:`VerlSetting`), verl's own local statistics, the loss's inputs
from verl's tensors, the loss, and what verl's loss of the same mode returns (:func:`verl_outputs`). The module
docstring of :mod:`~nemo_is_plugin.adapters.verl.policy_loss` says what each step means for verl.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from nemo_is_plugin.adapters.shared import renormalize
from nemo_is_plugin.adapters.verl.config import VERL_LOG_RATIO_CLAMP, _get
from nemo_is_plugin.adapters.verl.loss_modes import VERL_METRIC_NAMES, VerlMode
from nemo_is_plugin.adapters.verl.metrics import for_verl_step, plugin_metrics, rollout_corr_metrics, verl_statistics
from nemo_is_plugin.adapters.verl.score_centering import VERL_SC_METRICS, verl_centering_statistics

METRIC_PREFIX = "actor/nemo_is/"


@dataclass
class VerlSetting:
    """One distinct verl setting (the policy loss's cache key) and its losses, built on first use: the plugin's own
    (``weights_only`` False), and the one that applies verl's ``rollout_is_weights`` instead (True). ``build``: the
    loss of a ``weights_only`` value for this setting."""

    build: Any  # Callable[[bool], ClippedPGLoss]
    losses: dict[bool, Any] = field(default_factory=dict)

    def loss(self, weights_only: bool) -> Any:
        if weights_only not in self.losses:
            self.losses[weights_only] = self.build(weights_only)
        return self.losses[weights_only]


@torch.no_grad()
def local_statistics(
    log_prob: torch.Tensor, old_log_prob: torch.Tensor, m: torch.Tensor, mode: VerlMode
) -> dict[str, torch.Tensor]:
    """This micro-batch's token and sequence counts and verl's ``ppo_kl`` of ``mode`` (some verl modes clamp
    log pi - log pi_old to +-20 first), kept on the device until the loss's metrics are read (one host sync)."""
    log_ratio = log_prob - old_log_prob
    if mode.clamped_kl:
        log_ratio = log_ratio.clamp(-VERL_LOG_RATIO_CLAMP, VERL_LOG_RATIO_CLAMP)
    return {
        "local_toks": m.sum(),
        "local_seqs": (m.sum(-1) > 0).sum(),
        "ppo_kl": (-log_ratio * m).sum() / (m.sum() + 1e-8),
    }


def global_counts(config: Any, agg: str, all_rows: int | None = None) -> tuple[float | None, float | None]:
    """verl's ``agg_loss`` divisors (tokens, sequences): ``global / dp_size`` from ``global_batch_info``, else None
    (the local counts); without ``global_batch_size`` the sequence divisor is ``all_rows`` when given (verl's
    ``geo_mean``, which reads no ``global_batch_info`` and so needs none at any DP size)."""
    info = dict(_get(config, "global_batch_info", {}) or {})
    dp = int(info.get("dp_size") or 1)
    toks, seqs = info.get("batch_num_tokens"), info.get("global_batch_size")
    if dp > 1 and toks is None and agg == "token-mean":
        raise ValueError("(global) batch_num_tokens is required when dp_size > 1")
    if dp > 1 and seqs is None and all_rows is None and agg not in ("token-mean", "token-sum"):
        raise ValueError("global_batch_size is required when dp_size > 1")
    n_tok = float(toks) / dp if toks is not None else None
    n_seq = float(seqs) / dp if seqs is not None else None if all_rows is None else float(all_rows)
    return n_tok, n_seq


@dataclass
class LossRun:
    """What one run of the loss gives the outputs: the loss, its metrics, the caller's statistics read in the same
    host sync (``read``: verl's ``rollout_corr/`` and score-centering statistics), and the local counts."""

    loss: torch.Tensor
    metrics: Any  # MetricValues
    read: dict[str, float]
    local_toks: float
    local_seqs: float
    ppo_kl: float


def run_loss(loss_fn: Any, inputs: Any, layout: Any, own: dict[str, torch.Tensor], reads_mu: bool) -> LossRun:
    """The loss's terms, reduction and metrics on ``inputs``; ``own``: this call's device statistics
    (:func:`local_statistics`), read with the metrics, plus verl's score-centering statistics and, when the plugin
    reads log mu, verl's ``rollout_corr/`` statistics of the loss's own IS correction."""
    terms = loss_fn.terms(inputs, layout)
    own = {**own, **verl_centering_statistics(terms, None if inputs.head is None else inputs.head.trainer_head)}
    parts = loss_fn.reduce(terms)
    if reads_mu:
        own.update(verl_statistics(terms))
    metrics, read = loss_fn.metrics(terms, parts, read_with=own)
    local_toks, local_seqs, ppo_kl = read.pop("local_toks"), read.pop("local_seqs"), read.pop("ppo_kl")
    return LossRun(parts.loss, metrics, read, local_toks, local_seqs, ppo_kl)


def verl_loss(run: LossRun, loss_agg_mode: str, config: Any) -> torch.Tensor:
    """The loss as verl's ``agg_loss`` scales it: verl's ``token-sum`` is the local sum times dp_size (DP averages
    gradients), the plugin's the local sum."""
    if loss_agg_mode != "token-sum":
        return run.loss
    return run.loss * int(dict(_get(config, "global_batch_info", {}) or {}).get("dp_size") or 1)


def local_metrics(run: LossRun, counts: tuple[float | None, float | None]) -> dict[str, float]:
    """The loss's metrics renormalised to this micro-batch's own counts (verl averages per-micro-batch metrics)."""
    n_tok = run.local_toks if counts[0] is None else counts[0]
    n_seq = run.local_seqs if counts[1] is None else counts[1]
    return renormalize(run.metrics, tokens=(n_tok, run.local_toks), seqs=(n_seq, run.local_seqs))


def verl_values(local: Mapping[str, float], mode: VerlMode, ppo_kl: float) -> tuple[float, float, float]:
    """verl's ``pg_clipfrac``, ``ppo_kl``, ``pg_clipfrac_lower`` of ``mode`` (0 where the objective has no such clip,
    as verl's loss reports 0 then)."""
    clipfrac, lower = mode.clipfrac_metrics
    return local.get(clipfrac, 0.0), ppo_kl, local.get(lower, 0.0)


def verl_metric_dict(
    run: LossRun, local: Mapping[str, float], mode: VerlMode, loss_config: Any, rows: int, reads_mu: bool
) -> dict[str, Any]:
    """verl >= 0.6's metrics dict: the plugin's metrics under ``actor/nemo_is/``, verl's ``actor/`` metrics of
    ``mode``, and, when the plugin reads log mu (it measured the true mismatch), verl's ``rollout_corr/`` names where
    the quantity is the same; verl's score-centering metrics."""
    read = dict(run.read)
    verl_sc = {name: read.pop(name) for name in VERL_SC_METRICS if name in read}
    out: dict[str, Any] = {f"{METRIC_PREFIX}{k}": v for k, v in plugin_metrics(local, run.metrics.denominators).items()}
    values = dict(zip(VERL_METRIC_NAMES, verl_values(local, mode, run.ppo_kl)))
    out.update({name: values[name] for name in mode.metrics})
    if reads_mu:
        seqs = dict(seqs_with_tokens=run.local_seqs, seq_count=run.local_seqs)
        corr = rollout_corr_metrics(local, loss_config, rows=rows, **seqs)
        corr.update(read)  # verl's statistics the loss's metrics do not carry (verl_metrics.verl_statistics)
        out.update(for_verl_step(corr))  # the extrema named for verl's mean over micro-batches
    out.update(verl_sc)
    return out


__all__ = [
    "METRIC_PREFIX",
    "LossRun",
    "VerlSetting",
    "global_counts",
    "local_metrics",
    "local_statistics",
    "run_loss",
    "verl_loss",
    "verl_metric_dict",
    "verl_values",
]
