"""The IS correction of one batch: weight level -> truncation / masking / rejection -> optional batch normalisation.

Two code paths, chosen by whether the IS level was set explicitly:

- NeMo-RL's exact path (``is_correction_level`` unset: ``nemo_rl_exact``): NeMo-RL's order of operations, including
  its float32 edge behaviour: ``w = nan_to_num(exp(log w))`` (an overflowing weight becomes 0) and only then
  truncation;
- explicit level: truncation and band tests are done on log w, so they are exact and finite for any input.

A token whose generation log-prob is not finite (vLLM's -inf for a token its sampler filtered; NaN, +inf) has no IS
ratio. Explicit levels give weight 0 to every weight whose log-sum contains its term (``is_weights.unmeasured_weights``:
the token, its sequence at the sequence levels, the token and every later token of its sequence at the cumulative
level), after truncation (``tis`` gives 0, not its cap) and before batch normalisation (the zeros enter the mean, as
IcePop's do); the other weights, and every band statistic, count the term as 0. NeMo-RL's exact path keeps its rule
(``nan_to_num`` to 0, then truncation: ``tis`` lifts it to its ``min``). Any rejection (a sequence-masking truncation
type, ``rejection``, a rule, the veto) rejects the token itself on both paths, with or without IS weights.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypedDict

import torch

from nemo_is_plugin.loss import truncation as T
from nemo_is_plugin.loss.is_weights import (
    MAX_LOG_WEIGHT,
    finite_exp,
    is_log_weight,
    level_log_weight,
    unmeasured_weights,
)
from nemo_is_plugin.loss.layout import TokenLayout
from nemo_is_plugin.loss.masked import EPS, where_mask
from nemo_is_plugin.loss.rejection import RuleOutcome, RuleSpec, band_rule, evaluate_rules

SEQUENCE_LEVELS = ("sequence", "sequence_mean")
SEQUENCE_MASK_TYPES = ("seq-mask-tis", "seq-mis", "geo-rs")


@dataclass
class ISCorrection:
    """Result of :func:`compute_is_correction`; all token tensors have the layout's shape, all detached.

    weights: final weights w_t (1 where IS is off but rejection masks apply; 0 on rejected tokens).
    raw_weights: weights of the level before truncation / masking (for metrics).
    log_weights: log w of the level (for metrics that need the exact value, e.g. chi-square).
    out_of_band: bool, tokens whose weight the truncation type changed or tested out of band (``is_oob_ratio``).
    rejected: bool, tokens zeroed by icepop, sequence masks, rejection or veto, or for a non-finite generation
        log-prob (see the module docstring).
    seq_out_of_band: [S] bool for seq-mask-tis (NeMo-RL normalises its ``is_oob_ratio`` by sequences), else None.
    batch_norm_factor: the divisor of batch normalisation (1.0 when off).
    rules: the outcome of each rejection rule (``importance_sampling_rejection`` and the listed rules).
    rules_keep: bool, tokens every rejection rule keeps (None without rules).
    truncated / truncation_keep: the weights after the truncation type and the tokens its band keeps (IcePop, the
        sequence masks), before batch normalisation, rejections and the veto (what verl's IS metrics describe).
    """

    weights: torch.Tensor
    raw_weights: torch.Tensor
    log_weights: torch.Tensor
    out_of_band: torch.Tensor
    rejected: torch.Tensor
    seq_out_of_band: torch.Tensor | None
    batch_norm_factor: torch.Tensor
    rules: tuple[RuleOutcome, ...] = ()
    rules_keep: torch.Tensor | None = None
    truncated: torch.Tensor | None = None
    truncation_keep: torch.Tensor | None = None


class ISCorrectionOptions(TypedDict):
    """The keyword arguments of :func:`compute_is_correction` that a loss config fixes (``is_correction_kwargs``)."""

    level: str
    nemo_rl_exact: bool
    apply_weights: bool
    truncation: str | None
    low: float | None
    high: float | None
    veto_threshold: float | None
    batch_normalize: bool
    rules: Sequence[RuleSpec]


@torch.no_grad()
def compute_is_correction(
    prev: torch.Tensor,
    gen: torch.Tensor,
    token_mask: torch.Tensor,
    valid_mask: torch.Tensor,
    layout: TokenLayout,
    *,
    level: str,
    nemo_rl_exact: bool,
    apply_weights: bool,
    truncation: str | None,
    low: float | None,
    high: float | None,
    veto_threshold: float | None,
    batch_normalize: bool,
    rejection: str | None = None,
    rejection_low: float | None = None,
    rejection_high: float | None = None,
    rules: Sequence[RuleSpec] = (),
) -> ISCorrection:
    """Compute the IS weights of a batch.

    Args:
        prev, gen: Float[*T] training (prev) and rollout (generation) log-probs.
        token_mask: Float[*T] token mask alone (sequence means divide by its count, as NeMo-RL does).
        valid_mask: Float[*T] token_mask * sample_mask (tokens that enter sums).
        level: token | sequence | sequence_mean | cumulative.
        nemo_rl_exact: compute as NeMo-RL does, in its order of operations (the level was derived, not set).
        apply_weights: use_importance_sampling_correction; when False, weights are 1 except for rejections.
        truncation: tis | icepop | seq-mask-tis | seq-mis | geo-rs | None.
        low, high: truncation bounds on the weight.
        veto_threshold: reject a sequence whose smallest token weight is below this.
        rejection, rejection_low, rejection_high: seq-mis | geo-rs | None, applied after (and independently of) the
            truncation: a sequence whose ratio is outside the band gets weight 0 (compared in log space); the same as
            the k1 rule ``rejection.band_rule``, evaluated before ``rules``.
        rules: rejection rules (``nemo_is_plugin.loss.rejection``) that must all pass; applied like ``rejection``.
        batch_normalize: divide the truncated weights by their mean over valid tokens (sequence levels: over
            sequences), taken after the truncation type (IcePop's zeros included) and before sequence masks,
            rejections and the veto, as verl does.
    """
    # NeMo-RL sums the sequence log-weight over token_mask * sample_mask and the geometric mean over token_mask.
    level_mask = valid_mask if level == "sequence" else token_mask
    x = prev - gen
    measured = torch.isfinite(x)
    unmeasured = (token_mask != 0) & ~measured  # counted tokens without an IS ratio
    rejects = truncation in SEQUENCE_MASK_TYPES or rejection is not None or bool(rules) or veto_threshold is not None
    if nemo_rl_exact:
        log_w = is_log_weight(level, prev, gen, level_mask, layout)
        dropped = unmeasured if rejects else None
    else:
        # the other weights from finite terms only (a masked NaN must not reach a weight either: 0 * NaN gradients)
        log_w = level_log_weight(level, torch.where(measured, x, 0.0), level_mask, layout).clamp(max=MAX_LOG_WEIGHT)
        dropped = unmeasured_weights(level, unmeasured, level_mask, layout) if apply_weights else unmeasured
        log_w = torch.where(dropped, float("-inf"), log_w)
    raw = finite_exp(log_w)
    w, oob, keep, seq_oob = _truncated_weights(
        truncation, raw, log_w, prev, gen, token_mask, layout, low, high, nemo_rl_exact
    )
    if dropped is not None:  # 0, not the tis cap or min: before batch normalisation, whose mean counts it as 0
        w = torch.where(dropped, torch.zeros_like(w), w)
        keep = keep & ~dropped
    truncation_keep, truncated = keep, w
    rules_keep, outcomes = _rule_outcomes(
        prev, gen, token_mask, layout, rules, rejection, rejection_low, rejection_high
    )
    if rules_keep is not None:
        keep = keep & rules_keep
    if veto_threshold is not None:
        keep = keep & _veto_keep(x, measured, token_mask, layout, veto_threshold)

    if not apply_weights:
        w = torch.ones_like(raw)
    factor = torch.ones((), dtype=w.dtype, device=w.device)
    if batch_normalize:
        factor = _batch_norm_factor(w, truncation_keep, valid_mask, layout, truncation, level)
        w = w / torch.where(factor > 0, factor, torch.ones_like(factor))
    # Rejections act on counted tokens only: the tokens of a sample masked out by sample_mask keep their (unused)
    # weight whatever their values, as nothing may read those (NeMo-RL's GSPO sampling_importance_ratio sums every
    # row's weight).
    keep = keep | ((token_mask != 0) & (valid_mask == 0))
    w = torch.where(keep, w, torch.zeros_like(w))
    return ISCorrection(w, raw, log_w, oob, ~keep, seq_oob, factor, outcomes, rules_keep, truncated, truncation_keep)


def _truncated_weights(
    truncation: str | None,
    raw: torch.Tensor,
    log_w: torch.Tensor,
    prev: torch.Tensor,
    gen: torch.Tensor,
    token_mask: torch.Tensor,
    layout: TokenLayout,
    low: float | None,
    high: float | None,
    nemo_rl_exact: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The truncation type on the level's weights ``raw = exp(log_w)``: ``(weights, out_of_band, keep,
    seq_out_of_band)``, the tokens it changed or tested out of band, the tokens its band keeps and, for a sequence
    mask, its [S] sequences out of band. Tested on the weight on NeMo-RL's exact path, on log w otherwise."""
    w = raw
    oob = torch.zeros_like(raw, dtype=torch.bool)
    keep = torch.ones_like(raw, dtype=torch.bool)
    seq_oob = None
    if truncation == "tis":
        hi = _bound(high, "high", truncation)
        w, oob = T.tis(raw, low, hi) if nemo_rl_exact else T.tis_log(log_w, low, hi)
    elif truncation == "icepop":
        hi = _bound(high, "high", truncation)
        in_band = (
            T.band_mask(raw, _bound(low, "low", truncation), hi) if nemo_rl_exact else T.band_mask_log(log_w, low, hi)
        )
        oob, keep = ~in_band, in_band
    elif truncation in SEQUENCE_MASK_TYPES:
        hi = _bound(high, "high", truncation)
        seq_log = _sequence_log_ratio(prev, gen, token_mask, layout, geometric=truncation != "seq-mis")
        if nemo_rl_exact and truncation == "seq-mask-tis":
            in_band = T.band_mask(torch.exp(seq_log), _bound(low, "low", truncation), hi)
        else:
            in_band = T.band_mask_log(seq_log, low, hi)
        seq_oob = ~in_band
        keep = layout.to_tokens(in_band)
        oob = ~keep
    return w, oob, keep, seq_oob


def _rule_outcomes(
    prev: torch.Tensor,
    gen: torch.Tensor,
    token_mask: torch.Tensor,
    layout: TokenLayout,
    rules: Sequence[RuleSpec],
    rejection: str | None,
    rejection_low: float | None,
    rejection_high: float | None,
) -> tuple[torch.Tensor | None, tuple[RuleOutcome, ...]]:
    """The tokens every rejection rule keeps (None without rules) and each rule's outcome; ``rejection``'s band is
    the first rule."""
    if rejection is not None:
        band = band_rule(rejection, _bound(rejection_low, "low", rejection), _bound(rejection_high, "high", rejection))
        rules = (band, *rules)
    return evaluate_rules(rules, prev, gen, token_mask, layout) if rules else (None, ())


def _veto_keep(
    x: torch.Tensor, measured: torch.Tensor, token_mask: torch.Tensor, layout: TokenLayout, threshold: float
) -> torch.Tensor:
    """The tokens of the sequences whose smallest token weight ``exp(x)`` is at least ``threshold``."""
    # a non-finite term vetoes nothing (it counts as 0, and 0 >= log threshold)
    min_log = layout.seq_min(torch.where((token_mask != 0) & measured, x, torch.full_like(x, float("inf"))))
    return layout.to_tokens(T.veto_keep(min_log, threshold))


def _batch_norm_factor(
    w: torch.Tensor,
    truncation_keep: torch.Tensor,
    valid_mask: torch.Tensor,
    layout: TokenLayout,
    truncation: str | None,
    level: str,
) -> torch.Tensor:
    """The divisor of batch normalisation: as verl, the mean of the truncated weights (IcePop's zeros are weights)
    *before* sequence masks and rejections, which verl applies to the response mask instead."""
    trunc_w = torch.where(truncation_keep, w, torch.zeros_like(w)) if truncation == "icepop" else w
    return _batch_mean(trunc_w, valid_mask, layout, per_sequence=level in SEQUENCE_LEVELS)


def _bound(value: float | None, which: str, kind: str) -> float:
    """A band edge that ``kind`` needs (the config requires it with that truncation / rejection type)."""
    if value is None:
        raise ValueError(f"IS truncation / rejection {kind!r} needs its {which} bound, got None")
    return value


def _sequence_log_ratio(
    prev: torch.Tensor, gen: torch.Tensor, token_mask: torch.Tensor, layout: TokenLayout, *, geometric: bool
) -> torch.Tensor:
    """[S] log of the sequence ratio: sum_t (prev - gen) over the token mask, or its mean (``geometric``)."""
    x = torch.nan_to_num(prev - gen, nan=0.0, posinf=0.0, neginf=0.0)
    seq_log = layout.seq_sum(where_mask(x, token_mask))
    if geometric:
        seq_log = seq_log / (layout.seq_sum(token_mask.to(x.dtype)) + EPS)
    return seq_log


def _batch_mean(w: torch.Tensor, valid_mask: torch.Tensor, layout: TokenLayout, per_sequence: bool) -> torch.Tensor:
    """Mean weight over valid tokens, or over valid sequences for sequence levels (verl's rollout_is_batch_normalize).

    The mean spans this process's micro-batch and its CP shards (through the layout); not the DP-global batch.
    """
    # Counts are integers: clamp_min(1) (not +1e-8) keeps on-policy weights exactly 1 after normalisation.
    sums = torch.stack([where_mask(w, valid_mask).sum(), valid_mask.sum().to(w.dtype)])
    if per_sequence:
        count = layout.seq_sum(valid_mask.to(w.dtype))
        seq_w = layout.seq_sum(where_mask(w, valid_mask)) / count.clamp_min(1)
        has_tokens = (count > 0).to(w.dtype)
        return seq_w.mul(has_tokens).sum() / has_tokens.sum().clamp_min(1)
    sums = layout.reduce_metric_sums(sums)
    return sums[0] / sums[1].clamp_min(1)
