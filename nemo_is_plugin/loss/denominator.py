"""The global count a metric is divided by: a leaf of the loss package (it imports nothing), so that every module that
emits a metric (the MetricBook, score centering's term, the hosts' books) can name its denominator without importing
the metrics machinery above it."""

from __future__ import annotations

import enum


class Denominator(enum.Enum):
    """The global count a metric was divided by; the values are NeMo-RL's ``MetricNormalizer`` values."""

    TOKENS = "tokens"  # global_valid_toks
    SEQUENCES = "sequences"  # global_valid_seqs
    NONE = "none"  # none: extrema, raw counts, local means; never rescaled


__all__ = ["Denominator"]
