"""Experiment 1 (docs/evidence.md, 1): how the IS weight of each correction level behaves as responses get long.

For each mismatch distribution (see :mod:`.mismatch`) and response length L, draw ``num_seqs`` sequences of
per-token mismatch x = p - g, let the plugin compute the IS weight of every level (:func:`is_log_weight`
then :func:`finite_exp` of :mod:`nemo_is_plugin.loss.is_weights`), and summarise
the weight each token's gradient is multiplied by, pooled over all tokens: mean (= the effective learning-rate scale,
since the loss is linear in the weight), std, 5th/50th/95th percentiles, effective-sample-size fraction, and the mean
after TIS truncation at 2 (:func:`nemo_is_plugin.loss.truncation.tis_log`; the seed ran with
``truncated_importance_sampling_ratio: 2``).

The seed reports the exp(sum) weight at mean ~0.4, std ~0.27 with ~9k-token responses; :func:`seed_check` verifies
that the distribution fitted by :func:`.mismatch.fit_sequence_weight` reproduces it through the plugin's code.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from nemo_is_plugin.apps.evidence.mismatch import MismatchDistribution, fit_sequence_weight, unbiased_sampler
from nemo_is_plugin.apps.evidence.stats import weight_summary
from nemo_is_plugin.loss.is_weights import IS_LEVELS, finite_exp, is_log_weight
from nemo_is_plugin.loss.layout import TokenLayout
from nemo_is_plugin.loss.truncation import tis_log

LENGTHS = (64, 128, 256, 512, 1024, 2048, 4096, 8192, 9000, 16384)
SEED_LENGTH, SEED_MEAN, SEED_STD = 9000, 0.4, 0.27  # the reported run: Qwen3.5-35B-A3B, ~9k-token responses
TIS_HIGH = 2.0  # that run's truncated_importance_sampling_ratio


def default_distributions() -> list[MismatchDistribution]:
    """The seed fit, unbiased samplers with 1% and 2% per-token spread, and a 2% systematic shift."""
    return [
        fit_sequence_weight(SEED_MEAN, SEED_STD, SEED_LENGTH, name="seed fit"),
        unbiased_sampler("unbiased 1%", 0.01),
        unbiased_sampler("unbiased 2%", 0.02),
        MismatchDistribution("2% shift", -0.02, 0.02),
    ]


def level_weights(
    mismatch: torch.Tensor, level: str, layout: TokenLayout | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """IS weights of ``level`` for a batch of full-length sequences, computed by the plugin.

    Args:
        mismatch: Float64[B, L] per-token x = p - g (only the difference enters the weights, so g = 0 here).
        level: token | sequence | sequence_mean | cumulative.
        layout: ``TokenLayout.padded(B, L)``; pass it when calling for several levels (building it is not free).
    Returns:
        (w, log w): Float64[B, L] token tensors (sequence levels broadcast to every token).
    """
    if layout is None:
        num_seqs, seq_len = mismatch.shape
        layout = TokenLayout.padded(num_seqs, seq_len, device=mismatch.device)
    mask = torch.ones_like(mismatch)
    log_w = is_log_weight(level, mismatch, torch.zeros_like(mismatch), mask, layout)
    return finite_exp(log_w), log_w


def summarise(mismatch: torch.Tensor) -> dict[str, dict[str, float]]:
    """Per level: :func:`~.stats.weight_summary` of the token-pooled weights plus ``tis_mean`` (mean after TIS at 2)."""
    out = {}
    num_seqs, seq_len = mismatch.shape
    layout = TokenLayout.padded(num_seqs, seq_len, device=mismatch.device)
    for level in IS_LEVELS:
        w, log_w = level_weights(mismatch, level, layout)
        if level in ("sequence", "sequence_mean"):
            # Every sequence has L tokens, so the token-pooled distribution is the per-sequence one: skip the copies.
            w, log_w = w[:, :1], log_w[:, :1]
        summary = weight_summary(w)
        summary["tis_mean"] = float(tis_log(log_w, None, TIS_HIGH)[0].mean())
        out[level] = summary
    return out


def seed_check(dist: MismatchDistribution, num_seqs: int, rng: np.random.Generator) -> dict[str, float]:
    """Monte Carlo of the exp(sum) weight at the seed's length under ``dist``, against the seed and the CLT.

    Returns mean and std of the per-sequence weight with standard errors (std's from the delta method on the
    second moment), the lognormal prediction, and the same after TIS truncation at 2.
    """
    w, log_w = level_weights(dist.sample(num_seqs, SEED_LENGTH, rng), "sequence")
    seq_w = w[:, 0].numpy()
    truncated = tis_log(log_w[:, 0], None, TIS_HIGH)[0].numpy()
    n = len(seq_w)
    mean, std = float(seq_w.mean()), float(seq_w.std(ddof=1))
    # se(std) ~ sqrt(Var((w - mean)^2)) / (2 std sqrt(n)), valid for finite fourth moments (lognormal here).
    se_std = float(np.std((seq_w - mean) ** 2, ddof=1) / (2 * std * np.sqrt(n)))
    pred_mean, pred_std = dist.lognormal_sequence_weight(SEED_LENGTH)
    return {
        "length": SEED_LENGTH,
        "num_seqs": n,
        "mean": mean,
        "mean_se": std / float(np.sqrt(n)),
        "std": std,
        "std_se": se_std,
        "lognormal_mean": pred_mean,
        "lognormal_std": pred_std,
        "seed_mean": SEED_MEAN,
        "seed_std": SEED_STD,
        "tis_mean": float(truncated.mean()),
        "tis_std": float(truncated.std(ddof=1)),
    }


def run_is_collapse(
    *,
    num_seqs: int = 256,
    lengths: Sequence[int] = LENGTHS,
    distributions: Sequence[MismatchDistribution] | None = None,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
) -> dict:
    """Run the experiment. Returns a JSON-ready dict.

    ``stats[dist name][level][stat]`` is a list over ``lengths``; ``seed_check`` is :func:`seed_check` of the seed
    fit with 4x the sequences; ``distributions`` lists each distribution's parameters.
    """
    dists = list(distributions) if distributions is not None else default_distributions()
    rng = np.random.default_rng(seed)
    stats: dict[str, dict[str, dict[str, list[float]]]] = {}
    for dist in dists:
        per_level: dict[str, dict[str, list[float]]] = {lvl: {} for lvl in IS_LEVELS}
        for length in lengths:
            if progress:
                progress(f"IS weights: {dist.name}, L={length}")
            for level, summary in summarise(dist.sample(num_seqs, length, rng)).items():
                for key, value in summary.items():
                    per_level[level].setdefault(key, []).append(value)
        stats[dist.name] = per_level
    fit = next((d for d in dists if d.name == "seed fit"), None)
    check = seed_check(fit, 4 * num_seqs, rng) if fit is not None else None
    return {
        "lengths": list(lengths),
        "levels": list(IS_LEVELS),
        "num_seqs": num_seqs,
        "tis_high": TIS_HIGH,
        "distributions": [d.as_dict() | {"description": d.describe()} for d in dists],
        "stats": stats,
        "seed_check": check,
    }
