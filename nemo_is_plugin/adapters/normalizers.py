"""The host side of the metrics' denominators: NeMo-RL's ``LossType``, and rescaling metrics to other counts.

Every additive metric is "a local sum / a global count" (docs/design.md, metrics contract), and each metric declares
which count where the loss emits it (:class:`~nemo_is_plugin.loss.metrics.Denominator`; the loss returns them with
the values, and :meth:`~nemo_is_plugin.loss.clipped_pg.ClippedPGLoss.metric_denominators` lists them for a config).
"""

from __future__ import annotations

from typing import Any

from nemo_is_plugin.adapters.protocol import LossType
from nemo_is_plugin.config import ClippedPGLossConfig, ConfigError
from nemo_is_plugin.loss.metrics import Denominator, MetricValues


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


def renormalize(metrics: MetricValues, *, tokens: tuple[float, float], seqs: tuple[float, float]) -> dict[str, float]:
    """Change each metric's denominator from one count to another: ``tokens = (old, new)``, ``seqs = (old, new)``.

    E.g. from the global counts the loss divided by to this micro-batch's own counts, for hosts (verl) that average
    per-micro-batch metrics instead of summing them. A new count of 0 gives 0 (the metric's sum is 0 then too).
    The denominators are those ``metrics`` carry (each metric declares its own where the loss emits it).
    """
    factor = {
        Denominator.TOKENS: tokens[0] / tokens[1] if tokens[1] else 0.0,
        Denominator.SEQUENCES: seqs[0] / seqs[1] if seqs[1] else 0.0,
        Denominator.NONE: 1.0,
    }
    return {k: v * factor[metrics.denominators[k]] for k, v in metrics.items()}
