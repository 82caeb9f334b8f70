"""Which global count each metric of the plugin's loss is divided by; shared by the host adapters.

Every additive metric is "a local sum / a global count" (docs/design.md, metrics contract). A host that calls the loss
with placeholder counts (NeMo-RL's split API) or that averages per-micro-batch metrics (verl) must know, per metric,
*which* count: the token count, the sequence count, or none (extrema, raw counts, local means). Names ending in
``_min`` / ``_max`` are extrema.
"""

from __future__ import annotations

from typing import Any

import torch

from nemo_is_plugin.adapters.protocol import LossType, MetricNormalizer, is_extremum
from nemo_is_plugin.config import SEQUENCE_MASK_TYPES, ClippedPGLossConfig, ConfigError

# Metric -> the count it is divided by, where it is not the token count (see nemo_is_plugin.loss.metrics).
_SEQUENCE_METRICS = frozenset(
    {
        "sampling_importance_ratio_seq_mean",
        "is_rejected_seq_fraction",
        "training_log_ppl",
        "rollout_log_ppl",
        "log_ppl_diff",
        "log_ppl_abs_diff",
        "is_seq_weight_sq_mean",
    }
)
_RAW_METRICS = frozenset({"num_valid_samples", "positive_nll_loss"})  # a count, and a mean over a local count
_LOSS_METRICS = frozenset({"loss", "kl_penalty"})  # divided like the gradient


def loss_type_of(config: ClippedPGLossConfig) -> Any:
    """TOKEN_LEVEL when the loss is divided by the global token count, SEQUENCE_LEVEL when by the sequence count.

    ``token-sum`` is divided by neither, and NeMo-RL's LossType cannot say so: its split API would divide the summed
    loss by a count afterwards. Refused, loudly, rather than scaled wrongly.
    """
    agg = config.effective_loss_aggregation
    if agg == "token-sum":
        raise ConfigError(
            "loss_aggregation='token-sum' divides by no count, which NeMo-RL's LossType (TOKEN_LEVEL / "
            "SEQUENCE_LEVEL) cannot express: use 'token-mean' with NeMo-RL (token-sum is verl's mode)"
        )
    return LossType.TOKEN_LEVEL if agg == "token-mean" else LossType.SEQUENCE_LEVEL


def metric_normalizer(name: str, config: ClippedPGLossConfig) -> Any:
    """The global count the loss divides metric ``name`` by, as NeMo-RL's ``MetricNormalizer``."""
    if is_extremum(name) or name in _RAW_METRICS:
        return MetricNormalizer.NONE
    if name in _LOSS_METRICS:
        agg = config.effective_loss_aggregation
        if agg == "token-sum":
            return MetricNormalizer.NONE  # a plain sum: never rescaled
        return MetricNormalizer.TOKENS if agg == "token-mean" else MetricNormalizer.SEQUENCES
    if name in _SEQUENCE_METRICS or name.endswith("_rejected_seq_fraction"):
        return MetricNormalizer.SEQUENCES
    # is_oob_ratio counts sequences for the sequence-masking truncation types
    if name == "is_oob_ratio" and config.truncated_importance_sampling_type in SEQUENCE_MASK_TYPES:
        return MetricNormalizer.SEQUENCES
    if (
        name == "sampling_importance_ratio"
        and config.sequence_level_importance_ratios
        and config.is_correction_level is None
    ):
        return MetricNormalizer.SEQUENCES  # NeMo-RL's GSPO value: a sum over sequences divided by N_seq
    return MetricNormalizer.TOKENS


def probe_metric_names(loss: Any) -> list[str]:
    """The metric names ``loss`` emits for its config (names depend on the config only, not on the data)."""
    g = torch.Generator().manual_seed(0)
    b, s = 2, 4
    logp = lambda: -torch.rand(b, s, generator=g) - 0.1  # noqa: E731
    data = {
        "token_mask": torch.tensor([[0.0, 1.0, 1.0, 1.0], [0.0, 1.0, 1.0, 0.0]]),
        "sample_mask": torch.ones(b),
        "advantages": torch.randn(b, s, generator=g),
        "prev_logprobs": logp(),
        "generation_logprobs": logp(),
        "reference_policy_logprobs": logp(),
        "rewards": torch.tensor([1.0, 0.0]),
        "input_ids": torch.zeros(b, s, dtype=torch.long),
    }
    with torch.no_grad():
        _, metrics = loss(next_token_logprobs=logp()[:, 1:], data=data, global_valid_seqs=2.0, global_valid_toks=5.0)
    return list(metrics)


def renormalize(
    metrics: dict[str, float], config: ClippedPGLossConfig, *, tokens: tuple[float, float], seqs: tuple[float, float]
) -> dict[str, float]:
    """Change each metric's denominator from one count to another: ``tokens = (old, new)``, ``seqs = (old, new)``.

    E.g. from the global counts the loss divided by to this micro-batch's own counts, for hosts (verl) that average
    per-micro-batch metrics instead of summing them. A new count of 0 gives 0 (the metric's sum is 0 then too).
    """
    factor = {
        MetricNormalizer.TOKENS: tokens[0] / tokens[1] if tokens[1] else 0.0,
        MetricNormalizer.SEQUENCES: seqs[0] / seqs[1] if seqs[1] else 0.0,
        MetricNormalizer.NONE: 1.0,
    }
    return {k: v * factor[metric_normalizer(k, config)] for k, v in metrics.items()}
