"""The plugin's metrics under verl's ``rollout_corr/`` names, where the two compute the same quantity.

verl's definitions (``verl/trainer/ppo/rollout_corr_helper.py``, verl 0.9.1): ``kl`` = token mean of log mu - log
pi_old, ``k3_kl`` = token mean of e^x - 1 - x, ``training_log_ppl`` / ``rollout_log_ppl`` / ``log_ppl_diff`` /
``log_ppl_abs_diff`` = means over *all* rows of per-row token means (an empty row counts 0),
``chi2_token`` = E_tok[e^2x] - 1, ``chi2_seq`` = mean over all rows of e^{2 S} - 1 (an empty row counts e^0), and per
rejection option
``rollout_rs_<opt>_{mean, max, min, masked_fraction, seq_masked_fraction}`` (the seq fraction over rows with tokens)
with the overall ``rollout_rs_masked_fraction`` / ``rollout_rs_seq_masked_fraction`` (over all rows).

Not aliased: verl clamps x to +-20 in chi2 (the plugin does not; identical below e^20), and verl's IS-weight metrics
(``rollout_is_*``: their definitions changed between verl versions, and verl's batch-normalisation factor spans the
whole batch, the plugin's one micro-batch).
"""

from __future__ import annotations

from collections.abc import Mapping

from nemo_is_plugin.config import ClippedPGLossConfig

PREFIX = "rollout_corr/"
_SAME = {"kl": "mismatch_kl_k1", "k3_kl": "mismatch_kl_k3"}
_PER_ROW = ("training_log_ppl", "rollout_log_ppl", "log_ppl_diff", "log_ppl_abs_diff")
_RULE = {"mean": "mean", "max": "max", "min": "min", "masked_fraction": "rejected_fraction"}


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


__all__ = ["PREFIX", "rollout_corr_metrics"]
