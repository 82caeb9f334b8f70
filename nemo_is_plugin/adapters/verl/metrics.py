"""The plugin's metrics under verl's ``rollout_corr/`` names, with verl 0.9's definitions.

Two sources. :func:`rollout_corr_metrics` renames the loss's own metrics where the plugin computes the same quantity:
``kl`` = token mean of log mu - log pi_old, ``k3_kl`` = token mean of e^x - 1 - x, ``training_log_ppl`` /
``rollout_log_ppl`` / ``log_ppl_diff`` / ``log_ppl_abs_diff`` = means over *all* rows of per-row token means (an empty
row counts 0), ``chi2_token`` = E_tok[e^2x] - 1, ``chi2_seq`` = mean over all rows of e^{2 S} - 1 (an empty row counts
e^0), and per rejection option ``rollout_rs_<opt>_{mean, max, min, masked_fraction, seq_masked_fraction}`` (the seq
fraction over rows with tokens) with the overall ``rollout_rs_masked_fraction`` / ``rollout_rs_seq_masked_fraction``
(over all rows). verl clamps x to +-20 in chi2; the plugin does not (identical below e^20).

:func:`verl_statistics` computes the rest, as verl's ``verl/trainer/ppo/rollout_corr_helper.py`` (verl 0.9.1) does, from
the loss's own terms of the call (its IS correction and rule outcomes: nothing is computed twice): ``training_ppl``,
``rollout_ppl``, ``ppl_ratio``, ``log_ppl_diff_max`` / ``_min`` (``compute_offpolicy_metrics``); the IS-weight
statistics ``rollout_is_*`` (``compute_is_metrics``: since verl's #6806 mean / std / ESS / extrema / ``seq_*`` of the
*truncated* weights, the high / low fractions of the *raw* ones; ``rollout_is_oob_ratio`` with IcePop;
``rollout_is_batch_norm_factor`` with batch normalisation); and per rejection option the rest of ``compute_rs_metrics``
(``rollout_rs_<opt>_{fraction_high, fraction_low, std, seq_mean, seq_std, seq_max, seq_min, seq_max_deviation,
seq_fraction_high, seq_fraction_low}``). The weights are the plugin's (its level and truncation type, before batch
normalisation and rejections, as verl's), within verl's safety bound [e^-20, e^20]; the bounds are
``truncated_importance_sampling_ratio`` (none: no upper bound) and ``_ratio_min`` (default its reciprocal, as verl).
Levels with one weight per sequence (``sequence``, ``sequence_mean``) take verl's ``sequence`` formulas, the others
its ``token`` ones.

Scope. verl computes these once per step on the whole batch, in the driver. The plugin computes them per
micro-batch, and verl 0.9's ``ppo_loss`` averages a policy loss's metrics over micro-batches and DP ranks
(``AggregationType.MEAN``, whatever the name). So: token means and row means are verl's batch value when the
micro-batches hold equal token / row counts (row means: verl's fixed micro-batch size); the standard deviations and the
effective sample size are the average of the micro-batches' values, not the batch's value (the loss has no DP group to
reduce over); and the extrema (``_max``, ``_min``, ``_max_deviation``) are reported as
``<name>_micro_batch_mean`` (:func:`for_verl_step`), like the plugin's own: what verl makes of them is the mean of the
micro-batches' extrema, which no name promising an extremum may carry.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from nemo_is_plugin.loss.config_model import ClippedPGLossConfig
from nemo_is_plugin.loss.denominator import Denominator
from nemo_is_plugin.loss.objectives import OBJECTIVES
from nemo_is_plugin.loss.terms import LossTerms

PREFIX = "rollout_corr/"
VERL_SAFETY_BOUND = 20.0  # verl's SAFETY_BOUND: log-ratios are clamped to +-20 before exp in its metrics
_SAME = {"kl": "mismatch_kl_k1", "k3_kl": "mismatch_kl_k3"}
_PER_ROW = ("training_log_ppl", "rollout_log_ppl", "log_ppl_diff", "log_ppl_abs_diff")
_RULE = {"mean": "mean", "max": "max", "min": "min", "masked_fraction": "rejected_fraction"}
_PER_ROW_LEVELS = ("sequence", "sequence_mean")
# verl 0.9.1's ppo_loss (verl/workers/utils/losses.py) wraps every policy-loss metric in Metric(aggregation=MEAN), and
# TrainingWorker.train_mini_batch (verl/workers/engine_workers.py) averages each one over the micro-batches and the DP
# ranks (Metric.aggregate_dp); a Metric with another aggregation is refused there (Metric.extend). An extremum
# therefore reaches verl's metrics as the mean of the micro-batches' extrema, and is named so.
MICRO_BATCH_MEAN = "_micro_batch_mean"
# verl's rollout_corr/ statistics that are extrema of the call's tokens or rows (compute_is_metrics, compute_rs_metrics,
# compute_offpolicy_metrics: ..._max, ..._min, ..._seq_max_deviation)
_EXTREMUM_SUFFIXES = ("_max", "_min", "_max_deviation")


def plugin_metrics(local: Mapping[str, float], denominators: Mapping[str, Denominator]) -> dict[str, float]:
    """The plugin's metrics of one micro-batch as verl receives them (before ``actor/nemo_is/``).

    ``local``: the loss's metrics renormalised to the micro-batch's counts; ``denominators``: each one's
    :class:`~nemo_is_plugin.loss.denominator.Denominator`. Extrema (``_min`` / ``_max``, no denominator) get the suffix
    ``_micro_batch_mean`` (what verl makes of them, see ``MICRO_BATCH_MEAN``); the objective's derived statistics
    (``PolicyObjective.finalize``, e.g. M2PO's ``m2po_m2`` / ``m2po_m2_after``) are added, over this micro-batch (where
    verl's step computes M2PO's statistic, docs/verl.md), and reach verl averaged like every other metric.
    """
    out = {}
    for name, value in local.items():
        extremum = denominators.get(name) is Denominator.NONE and name.endswith(("_min", "_max"))
        out[name + MICRO_BATCH_MEAN if extremum else name] = value
    for objective in OBJECTIVES.values():
        out.update(objective.finalize(local))
    return out


def verl_step_name(name: str) -> str:
    """A ``rollout_corr/`` metric's name as the adapter reports it to verl's step: an extremum (``_max``, ``_min``,
    ``_max_deviation``) gets ``_micro_batch_mean`` (verl averages it over the micro-batches, see ``MICRO_BATCH_MEAN``);
    every other name (and every name outside ``rollout_corr/``) is kept."""
    return name + MICRO_BATCH_MEAN if name.startswith(PREFIX) and name.endswith(_EXTREMUM_SUFFIXES) else name


def for_verl_step(metrics: Mapping[str, float]) -> dict[str, float]:
    """``rollout_corr/`` metrics of one call (verl's names and values) under the names :func:`verl_step_name` gives."""
    return {verl_step_name(name): value for name, value in metrics.items()}


def rollout_corr_metrics(
    metrics: Mapping[str, float], config: ClippedPGLossConfig, *, rows: float, seqs_with_tokens: float, seq_count: float
) -> dict[str, float]:
    """verl's ``rollout_corr/<name>`` from the plugin's metrics.

    Args:
        metrics: the plugin's metrics, sequence metrics divided by ``seq_count``.
        rows: verl's row count (all rows, empty ones included); seqs_with_tokens: rows with at least one token.
    """
    to_valid = seq_count / seqs_with_tokens if seqs_with_tokens else 0.0
    to_rows = seq_count / rows if rows else 0.0
    out = {PREFIX + verl: metrics[ours] for verl, ours in _SAME.items() if ours in metrics}
    out.update({PREFIX + name: metrics[name] * to_rows for name in _PER_ROW if name in metrics})
    if "is_token_weight_sq_mean" in metrics:
        out[PREFIX + "chi2_token"] = metrics["is_token_weight_sq_mean"] - 1.0
    if "is_seq_weight_sq_mean" in metrics and rows:
        out[PREFIX + "chi2_seq"] = metrics["is_seq_weight_sq_mean"] * to_rows + (rows - seqs_with_tokens) / rows - 1.0
    rules = config.rejection_rules
    for rule in rules:
        option, ours = rule.verl_option, f"is_rejection_{rule.name}_"
        if option is None or ours + "mean" not in metrics:
            continue
        theirs = f"{PREFIX}rollout_rs_{option}_"
        out.update({theirs + verl: metrics[ours + name] for verl, name in _RULE.items()})
        out[theirs + "seq_masked_fraction"] = metrics[ours + "rejected_seq_fraction"] * to_valid
    if rules and all(rule.verl_option for rule in rules) and "is_rejection_rejected_fraction" in metrics:
        out[PREFIX + "rollout_rs_masked_fraction"] = metrics["is_rejection_rejected_fraction"]
        out[PREFIX + "rollout_rs_seq_masked_fraction"] = metrics["is_rejection_rejected_seq_fraction"] * to_rows
    return out


@torch.no_grad()
def verl_statistics(terms: LossTerms) -> dict[str, torch.Tensor]:
    """verl's ``rollout_corr/`` statistics that :func:`rollout_corr_metrics` cannot rename, over this micro-batch, from
    the loss's terms: the log-probs the IS weights divide (pi_old; the current policy, detached, in bypass mode), log
    mu, the token mask, and the loss's IS correction (its weights at the plugin's level and truncation type, before
    batch normalisation and rejections, as verl's metrics describe them; each rule's statistic).

    Returns 0-d float64 tensors under their ``rollout_corr/`` names (read with the loss's metrics: no host sync).
    """
    config, corr = terms.term_inputs.config, terms.correction
    p, g = terms.is_prev.double(), terms.term_inputs.mu.double()
    m = terms.term_inputs.token_mask.to(torch.float64)
    out = off_policy_statistics(p, g, m)
    if config.use_importance_sampling_correction and corr.truncated is not None and corr.truncation_keep is not None:
        factor = corr.batch_norm_factor if config.importance_sampling_batch_normalize else None
        truncated = torch.where(corr.truncation_keep, corr.truncated, torch.zeros_like(corr.truncated))
        out.update(is_weight_statistics(corr.log_weights.double(), truncated.double(), m, config, factor))
    for rule, outcome in zip(config.rejection_rules, corr.rules, strict=True):
        option = rule.verl_option
        if option is None:
            continue
        upper = rule.max if rule.max is not None else math.inf
        seq_stat = None if outcome.seq_stat is None else outcome.seq_stat.double()
        out.update(rejection_statistics(option, outcome.token_stat.double(), seq_stat, m, rule.min, upper))
    return {PREFIX + k: v for k, v in out.items()}


# ---------------------------------------------------------------------------------------------------------------------
# verl's statistics computed from the tensors (0-d float64, on the inputs' device, no host synchronisation)
# ---------------------------------------------------------------------------------------------------------------------


def _mean(v: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """verl_F.masked_mean over every element: sum(v m) / (sum m + 1e-8)."""
    return torch.where(m != 0, v * m, torch.zeros_like(v)).sum() / (m.sum() + 1e-8)


def _row_mean(v: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """verl_F.masked_mean(v, m, axis=-1): one value per row, 0 for an empty row."""
    return torch.where(m != 0, v * m, torch.zeros_like(v)).sum(-1) / (m.sum(-1) + 1e-8)


def _extrema(v: torch.Tensor, keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(max, min) of ``v`` where ``keep``."""
    inf = torch.full_like(v, math.inf)
    return torch.where(keep, v, -inf).amax(), torch.where(keep, v, inf).amin()


def _std(v: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """torch's unbiased std of the kept values; 0 for fewer than two (verl's rule)."""
    k = keep.to(v.dtype)
    n = k.sum()
    mean = (v * k).sum() / n.clamp_min(1)
    var = (((v - mean) * k) ** 2).sum() / (n - 1).clamp_min(1)
    return torch.where(n > 1, var.sqrt(), torch.zeros_like(var))


def _clamped_std(v: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """verl's token std: sqrt(max(E[v^2] - E[v]^2, 0)) over the mask, 0 for fewer than two tokens."""
    var = _mean(v.square(), m) - _mean(v, m).square()
    return torch.where(m.sum() > 1, var.clamp_min(0.0).sqrt(), torch.zeros_like(var))


def _fraction(flags: torch.Tensor) -> torch.Tensor:
    return flags.to(torch.float64).mean()


def off_policy_statistics(prev: torch.Tensor, gen: torch.Tensor, m: torch.Tensor) -> dict[str, torch.Tensor]:
    """``compute_offpolicy_metrics``'s perplexities: means over all rows (an empty row has mean log-prob 0)."""
    mean_prev, mean_gen = _row_mean(prev, m), _row_mean(gen, m)
    log_ppl_diff = mean_gen - mean_prev
    diff_max, diff_min = log_ppl_diff.amax(), log_ppl_diff.amin()
    return {
        "training_ppl": torch.exp(-mean_prev).mean(),
        "rollout_ppl": torch.exp(-mean_gen).mean(),
        "ppl_ratio": torch.exp(log_ppl_diff).mean(),
        "log_ppl_diff_max": diff_max,
        "log_ppl_diff_min": diff_min,
    }


def is_weight_statistics(
    log_w: torch.Tensor,
    weights: torch.Tensor,
    m: torch.Tensor,
    config: ClippedPGLossConfig,
    batch_norm_factor: torch.Tensor | None,
) -> dict[str, torch.Tensor]:
    """``compute_is_metrics`` (+ the IcePop ``oob_ratio`` and the ``batch_norm_factor``) of the plugin's weights.

    Args:
        log_w: Float[B, T] the log weight of the plugin's level (a sequence level's value on every token of its row).
        weights: Float[B, T] the truncated weights before batch normalisation and rejections.
        m: Float[B, T] verl's response mask.
        batch_norm_factor: the plugin's divisor (``importance_sampling_batch_normalize``), else None.
    """
    upper = config.truncated_importance_sampling_ratio or math.inf
    low = config.truncated_importance_sampling_ratio_min
    lower = low if low is not None else 1.0 / upper
    valid = m != 0
    raw = torch.exp(log_w.clamp(-VERL_SAFETY_BOUND, VERL_SAFETY_BOUND))
    lo, hi = math.exp(-VERL_SAFETY_BOUND), math.exp(VERL_SAFETY_BOUND)
    w = torch.where(weights > 0, weights.clamp(lo, hi), torch.zeros_like(weights))
    out = {"rollout_is_mean": _mean(w, m)}
    if config.effective_is_level in _PER_ROW_LEVELS:
        row_log = log_w[:, 0]  # every row, an empty one with log weight 0, as verl's [B, 1] log-ratio sums
        log_max, log_min = row_log.amax(), row_log.amin()
        out["rollout_is_max"] = torch.exp(log_max.clamp(max=VERL_SAFETY_BOUND))
        out["rollout_is_min"] = torch.exp(log_min)
        out["rollout_is_ratio_fraction_high"] = _fraction(row_log > math.log(upper))
        out["rollout_is_ratio_fraction_low"] = _fraction(row_log < (math.log(lower) if lower > 0 else -math.inf))
    else:
        out["rollout_is_max"], out["rollout_is_min"] = _extrema(w, valid)
        out["rollout_is_ratio_fraction_high"] = _mean((raw > upper).to(w.dtype), m)
        out["rollout_is_ratio_fraction_low"] = _mean((raw < lower).to(w.dtype), m)
    w_c = w.clamp(0.0, upper)
    out["rollout_is_std"] = _clamped_std(w_c, m)
    out["rollout_is_eff_sample_size"] = 1.0 / _mean((w_c / (_mean(w_c, m) + 1e-8)).square(), m)
    seq_w = _row_mean(w, m)
    every_row = torch.ones_like(seq_w, dtype=torch.bool)
    out["rollout_is_seq_mean"] = seq_w.mean()
    out["rollout_is_seq_std"] = _std(seq_w, every_row)
    out["rollout_is_seq_max"], out["rollout_is_seq_min"] = _extrema(seq_w, every_row)
    out["rollout_is_seq_max_deviation"] = (seq_w - 1.0).abs().amax()
    raw_seq = _row_mean(raw, m)
    out["rollout_is_seq_fraction_high"] = _fraction(raw_seq > upper)
    out["rollout_is_seq_fraction_low"] = _fraction(raw_seq < lower)
    if config.truncated_importance_sampling_type == "icepop":
        out["rollout_is_oob_ratio"] = _mean(((raw < lower) | (raw > upper)).to(w.dtype), m)
    if batch_norm_factor is not None:
        out["rollout_is_batch_norm_factor"] = torch.where(
            batch_norm_factor > 1e-8, batch_norm_factor, torch.ones_like(batch_norm_factor)
        )
    return out


def rejection_statistics(
    option: str,
    token_stat: torch.Tensor,
    seq_stat: torch.Tensor | None,
    m: torch.Tensor,
    lower: float | None,
    upper: float,
) -> dict[str, torch.Tensor]:
    """``compute_rs_metrics`` beyond mean / max / min for one option (verl's thresholds: k1's log-ratio band
    ``[lower, upper]``, k2 / k3's ``upper``; ``lower`` None means no lower threshold, which verl logs as 0)."""
    rows = m.sum(-1) > 0
    seq_values = seq_stat if seq_stat is not None else _row_mean(token_stat, m)
    clamp_min = lower if lower is not None else 0.0
    prefix = f"rollout_rs_{option}_"
    out = {}
    if seq_stat is not None:  # verl's sequence-level options: fractions over the rows with tokens
        out["fraction_high"] = _mean((seq_values > upper).to(m.dtype), rows.to(m.dtype))
        low = _mean((seq_values < clamp_min).to(m.dtype), rows.to(m.dtype))
    else:
        out["fraction_high"] = _mean((token_stat > upper).to(m.dtype), m)
        low = _mean((token_stat < clamp_min).to(m.dtype), m)
    out["fraction_low"] = low if lower is not None else torch.zeros_like(low)
    out["std"] = _clamped_std(token_stat.clamp(clamp_min, upper), m)
    out["seq_mean"] = _mean(seq_values, rows.to(m.dtype))
    out["seq_std"] = _std(seq_values, rows)
    out["seq_max"], out["seq_min"] = _extrema(seq_values, rows)
    out["seq_max_deviation"] = _extrema(seq_values.abs(), rows)[0]
    out["seq_fraction_high"] = _mean((seq_values > upper).to(m.dtype), rows.to(m.dtype))
    if lower is not None:
        out["seq_fraction_low"] = _mean((seq_values < lower).to(m.dtype), rows.to(m.dtype))
    return {prefix + k: v for k, v in out.items()}


__all__ = [
    "MICRO_BATCH_MEAN",
    "PREFIX",
    "VERL_SAFETY_BOUND",
    "for_verl_step",
    "is_weight_statistics",
    "off_policy_statistics",
    "plugin_metrics",
    "rejection_statistics",
    "rollout_corr_metrics",
    "verl_statistics",
    "verl_step_name",
]
