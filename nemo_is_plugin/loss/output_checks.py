"""What the loss reports or refuses once it has run, on inputs the validation (``input_validation``) accepted.

- :func:`input_anomalies` / :func:`warn_input_anomalies`: what the tolerant input mode computed as given (non-finite
  generation log-probs, positive log-probs on valid tokens), as the ``input_*_fraction`` metrics and a one-time
  warning;
- :func:`check_finite_loss`: the one accepted input whose loss is not finite (a policy ratio beyond the dtype's range),
  refused in one line naming the old log-probs.

Both read values already computed: the indicators stay on the device until the metrics' one host read, and the refusal
reads the metrics that read brought back.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from nemo_is_plugin.common.once import warn_once
from nemo_is_plugin.loss.input_values import POSITIVE_LOGPROB_TOLERANCE


@torch.no_grad()
def input_anomalies(
    valid: torch.Tensor, generation: torch.Tensor, logprobs: Mapping[str, torch.Tensor | None]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Indicators (Float[*T], on the inputs' device, no host sync) of what the tolerant mode computes as given.

    Args:
        valid: Float[*T] token_mask * sample_mask; padding is never counted.
        generation: Float[*T] generation log-probs as passed (any dtype).
        logprobs: every log-prob tensor the loss reads (Float[*T] or None), in its input dtype.
    Returns:
        (valid tokens whose generation log-prob is NaN or +-inf, valid tokens where some finite log-prob exceeds its
        dtype's ``POSITIVE_LOGPROB_TOLERANCE``), both 0/1 in ``valid``'s dtype.
    """
    ok = valid != 0
    positive = torch.zeros_like(ok)
    for t in logprobs.values():
        if t is not None:
            positive = positive | ((t > POSITIVE_LOGPROB_TOLERANCE.get(t.dtype, 1e-4)) & torch.isfinite(t))
    nonfinite = ok & ~torch.isfinite(generation)
    return nonfinite.to(valid.dtype), (ok & positive).to(valid.dtype)


# metric name -> (one-time warning key, what it means)
ANOMALY_METRICS = {
    "input_nonfinite_generation_fraction": (
        "nonfinite_generation",
        "data['generation_logprobs'] holds NaN / inf on valid tokens: their IS weights are 0 and the mismatch "
        "metrics NeMo-RL reports become inf / NaN, as in NeMo-RL",
    ),
    "input_positive_logprob_fraction": (
        "positive_logprob",
        "log-probs above 0 (beyond log_softmax rounding) on valid tokens are used as given, as in NeMo-RL",
    ),
}


def warn_input_anomalies(metrics: Mapping[str, float]) -> None:
    """One warning per kind and process when the metrics of :func:`input_anomalies` are non-zero."""
    for name, (key, meaning) in ANOMALY_METRICS.items():
        if metrics.get(name, 0.0) > 0:
            warn_once(
                key, f"{meaning} (metric {name} = {metrics[name]:.3g}); set strict_input_checks: true to raise instead"
            )


class NonFiniteLossError(ValueError):
    """The loss of inputs the validation accepted is not finite: a policy ratio overflowed the loss dtype."""


def check_finite_loss(
    metrics: Mapping[str, float],
    curr: torch.Tensor,
    anchor: torch.Tensor,
    valid: torch.Tensor,
    anchor_name: str,
    *,
    ratio_has_gradient: bool,
) -> None:
    """Refuse, in one line naming the old log-probs, a loss that is not finite, or a policy ratio that overflowed.

    Every input the validation accepts gives a finite loss except one: a policy ratio exp(c - pi_old) beyond the
    loss dtype's range (log r > 88.7 in float32), from old log-probs far below the current ones (e.g. a -100
    sentinel on a valid token) or a sequence / cumulative log-ratio that drifted that far. NeMo-RL's loss is then inf,
    or finite with a NaN gradient (0 * inf in the backward of PPO's clip or dual clip, whose unclipped branch the
    gradient always passes): no host-side check on the gradient is possible, so an overflowed ratio
    (``probs_ratio_max`` = inf) of such a surrogate is refused too. Reads only the metrics already on the host; the
    diagnosis runs on the error path only.

    Args:
        metrics: the loss's metrics (``loss``, ``probs_ratio_max``).
        curr, anchor, valid: Float[*T] current log-probs, the old log-probs the ratio divides by, counted tokens.
        anchor_name: the data key of ``anchor`` (``prev_logprobs``, or ``generation_logprobs`` in bypass mode).
        ratio_has_gradient: the surrogate differentiates the ratio exp(log r) itself (PPO's ratio or log-space clip),
            so that an overflowed ratio makes the gradient NaN (CISPO, the other objectives and the metrics' ratio of
            GMPO / DRO do not).
    """
    loss, ratio_max = metrics.get("loss", 0.0), metrics.get("probs_ratio_max", 0.0)
    if math.isfinite(loss) and not (ratio_has_gradient and ratio_max == math.inf):
        return
    d = torch.where(valid != 0, curr.detach().double() - anchor.detach().double(), -math.inf)
    flat = int(d.reshape(-1).argmax())
    largest = d.reshape(-1)[flat].item()
    where: list[int] = []
    for size in reversed(d.shape):
        flat, i = divmod(flat, size)
        where.insert(0, i)
    what = f"the loss is {loss}" if not math.isfinite(loss) else "the policy ratio overflows (probs_ratio_max = inf)"
    raise NonFiniteLossError(
        f"{what}: exp(c - pi_old) exceeds {curr.dtype if curr.dtype == torch.float64 else torch.float32}'s range; the "
        f"largest next_token_logprobs - {anchor_name} on a valid token is {largest:.4g} at token "
        f"{where} of the loss's token tensors (NeMo-RL's [B, S-1]: column + 1 in data); check {anchor_name} (a "
        "sentinel such as -100 or a wrong token on a valid position?), or cap log r with max_log_ratio"
    )
