"""The closed vocabularies of the loss config: each option's allowed values, and the groups the checks use.

Imports without torch.
"""

from __future__ import annotations

from typing import Literal, get_args

RatioLevel = Literal["token", "sequence", "sequence_token", "cumulative", "cumulative_mean"]
ISCorrectionLevel = Literal["token", "sequence", "sequence_mean", "cumulative"]
TruncationType = Literal["tis", "icepop", "seq-mask-tis", "seq-mis", "geo-rs"]
RejectionType = Literal["seq-mis", "geo-rs"]
KLType = Literal["k1", "k2", "k3"]
KLGradient = Literal["estimator", "k2"]
LossAggregation = Literal[
    "token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"
]

# Aggregations without a per-sequence normalisation: NeMo-RL's token_level_loss=true.
TOKEN_AGGREGATIONS = ("token-mean", "token-sum")
# Truncation types that reject whole sequences instead of reweighting tokens; they may run without IS weights.
REJECTION_TYPES: tuple[str, ...] = get_args(RejectionType)
# Truncation types that mask whole sequences by a sequence statistic.
SEQUENCE_MASK_TYPES = ("seq-mask-tis", *REJECTION_TYPES)
OldPolicyLogprobs = Literal["prev", "generation"]
