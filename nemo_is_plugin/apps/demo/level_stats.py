"""IS-weight statistics of one demo batch at every IS level, computed with the loss's own ``is_weights`` (the loss
itself reports only its configured level): what the demo's metrics rows, plots and summary compare."""

from __future__ import annotations

import torch

from nemo_is_plugin.loss.is_weights import IS_LEVELS, finite_exp, is_log_weight
from nemo_is_plugin.loss.layout import TokenLayout


@torch.no_grad()
def level_stats(prev: torch.Tensor, gen: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """IS-weight statistics at each level on one batch ([B, R] response-aligned tensors).

    mean / std / ESS are over valid tokens (a sequence-level weight counts once per token; every long-phase response
    has the same length, so there it is the per-sequence statistic); ``far`` is the fraction of tokens whose weight
    is outside [1/2, 2].
    """
    layout = TokenLayout.padded(*mask.shape)
    m = mask.double()
    n = m.sum().clamp_min(1.0)
    out = {}
    for level in IS_LEVELS:
        w = finite_exp(is_log_weight(level, prev.double(), gen.double(), m, layout))
        mean = (w * m).sum() / n
        sq = (w * w * m).sum() / n
        out[f"is/{level}_mean"] = float(mean)
        out[f"is/{level}_std"] = float((sq - mean * mean).clamp_min(0).sqrt())
        out[f"is/{level}_ess"] = float(mean * mean / sq) if sq > 0 else 0.0
        out[f"is/{level}_min"] = float(w[m > 0].min()) if n > 0 else 1.0
        out[f"is/{level}_max"] = float(w[m > 0].max()) if n > 0 else 1.0
        out[f"is/{level}_far"] = float((((w < 0.5) | (w > 2.0)).double() * m).sum() / n)
    return out
