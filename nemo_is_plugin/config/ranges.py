"""The valid interval of every numeric ``loss_fn`` key, why, and what to write instead (docs/config.md, *Valid ranges*).

:class:`nemo_is_plugin.config.ClippedPGLossConfig` checks every set value against :data:`NUMERIC_RANGES` when it is
validated, before the combination checks. Imports without torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypedDict


@dataclass(frozen=True)
class NumericRange:
    """The valid interval of one numeric key, why, and what to write instead (docs/config.md, *Valid ranges*)."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    why: str = ""
    fix: str = ""

    def contains(self, value: float) -> bool:
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return not (self.high is not None and (value >= self.high if self.high_open else value > self.high))

    def interval(self) -> str:
        lo = "(-inf" if self.low is None else ("(" if self.low_open else "[") + f"{self.low:g}"
        hi = "inf)" if self.high is None else f"{self.high:g}" + (")" if self.high_open else "]")
        return f"{lo}, {hi}"


class _Bound(TypedDict):
    low: float
    low_open: bool


_POS: _Bound = {"low": 0.0, "low_open": True}
# Every numeric key; null (where allowed) always means "off". w = 1 is the weight of an on-policy token, so every band
# on an IS weight must contain 1: a band without it acts on data with no mismatch at all.
NUMERIC_RANGES: dict[str, NumericRange] = {
    "reference_policy_kl_penalty": NumericRange(
        low=0.0,
        why="beta weights a penalty; a negative beta rewards moving away from the reference policy",
        fix="use 0 to turn the KL term off",
    ),
    "kl_input_clamp_value": NumericRange(
        **_POS,
        why="log(pi_ref / pi) is clamped to [-v, v]; v <= 0 makes that interval empty or a single point",
        fix="use a positive value (NeMo-RL: 20) or null for no clamp",
    ),
    "kl_output_clamp_value": NumericRange(
        **_POS,
        why="the per-token KL is clamped to [-v, v]; v <= 0 makes that interval empty or a single point",
        fix="use a positive value (NeMo-RL: 10) or null for no clamp",
    ),
    "ratio_clip_min": NumericRange(
        low=0.0,
        high=1.0,
        why="the PPO band's lower edge 1 - ratio_clip_min must lie in [0, 1]: a negative value puts "
        "it above 1 (an inverted band without ratio 1), a value above 1 puts it below 0, where no ratio lies",
        fix="use e.g. 0.2, or 1.0 for no lower clip (NeMo-RL's CISPO recipe)",
    ),
    "ratio_clip_max": NumericRange(
        low=0.0,
        why="the PPO band's upper edge 1 + ratio_clip_max must be >= 1: a negative value excludes ratio 1",
        fix="use e.g. 0.2 or 0.28 (DAPO's clip-higher)",
    ),
    "ratio_clip_c": NumericRange(
        low=1.0,
        low_open=True,
        why="the dual clip caps the loss of A < 0 at -A * c, which must lie above the clipped ratio's 1",
        fix="use e.g. 3.0, or null to disable dual clipping",
    ),
    "truncated_importance_sampling_ratio": NumericRange(
        **_POS,
        why="truncated_importance_sampling_ratio should be positive: it is the upper bound of the IS weight (a "
        "bound below 1 also truncates on-policy tokens, w = 1: a deliberate learning-rate cut that NeMo-RL's own tests "
        "use, so it is allowed)",
        fix="use e.g. 2.0 (tis) or 5.0 (icepop)",
    ),
    "truncated_importance_sampling_ratio_min": NumericRange(
        low=0.0,
        why="the lower bound of the IS weight (0 = none); that it does not exceed "
        "truncated_importance_sampling_ratio is checked with it, in NeMo-RL's words",
        fix="use e.g. 0.5 (icepop), 0.999 (seq-mask-tis / geo-rs) or null",
    ),
    "positive_example_nll_weight": NumericRange(
        low=0.0,
        why="the weight of the NLL of rewarded samples; NeMo-RL silently drops the term for a weight <= 0, so "
        "a negative weight is a typo (it would push their probability down if applied)",
        fix="use 0 to turn it off",
    ),
    "log_ratio_clip_low": NumericRange(
        **_POS,
        why="the log-space band is [-eps_low * t^p, eps_high * t^p]; eps <= 0 excludes log r = 0",
        fix="use e.g. 0.025 (CTPO) or leave both log_ratio_clip keys null",
    ),
    "log_ratio_clip_high": NumericRange(
        **_POS,
        why="the log-space band is [-eps_low * t^p, eps_high * t^p]; eps <= 0 excludes log r = 0",
        fix="use e.g. 0.05 (CTPO) or leave both log_ratio_clip keys null",
    ),
    "log_ratio_clip_c": NumericRange(
        **_POS,
        why="the log-space dual clip caps the loss of A < 0 at -A * exp(eps_c * t^p), which must lie above 1",
        fix="use e.g. 0.05 (CTPO) or null",
    ),
    "clip_position_power": NumericRange(
        low=-1.0,
        high=1.0,
        why="a cumulative log-ratio grows at most linearly in the position t, so bounds eps * t^p "
        "with p > 1 outgrow every reachable log-ratio (the clip silently turns off) and p < -1 shrink faster than "
        "1/t (every late token is clipped)",
        fix="use 0 (fixed bounds) or 0.5 (CTPO)",
    ),
    "token_log_ratio_clamp": NumericRange(
        **_POS,
        why="each token log-ratio is clamped to [-v, v]; v <= 0 forces every ratio to 1",
        fix="use e.g. 20 (CTPO, verl) or null",
    ),
    "max_log_ratio": NumericRange(
        **_POS,
        why="log r is capped at this value with zero gradient beyond; a cap <= 0 freezes every token whose "
        "ratio exceeds 1",
        fix="use e.g. 10 (CTPO) or null",
    ),
    "importance_sampling_rejection_min": NumericRange(
        low=0.0,
        high=1.0,
        low_open=True,
        why="the rejection band is tested in log space and must contain the on-policy weight 1",
        fix="use e.g. 0.5 (seq-mis) or 0.999 (geo-rs)",
    ),
    "importance_sampling_rejection_max": NumericRange(
        low=1.0,
        why="the rejection band must contain the on-policy weight 1",
        fix="use e.g. 2.0 (seq-mis) or 1.001 (geo-rs)",
    ),
    "importance_sampling_veto_threshold": NumericRange(
        low=0.0,
        high=1.0,
        low_open=True,
        high_open=True,
        why="a sequence is vetoed if a token weight falls below "
        "the threshold; at 1 or above on-policy tokens (w = 1) veto their sequence",
        fix="use e.g. 1e-4, or null",
    ),
    "loss_aggregation_norm": NumericRange(
        **_POS, why="the per-sequence divisor of seq-mean-token-sum-norm", fix="use the maximum response length"
    ),
}


def range_errors(cfg: Any) -> list[str]:
    """Each set numeric key outside its :data:`NUMERIC_RANGES` interval: the key, the value, why, and the fix."""
    out = []
    for key, rng in NUMERIC_RANGES.items():
        value = getattr(cfg, key)
        if value is not None and not rng.contains(value):
            out.append(f"{key}={value:g} is outside its valid range {rng.interval()}: {rng.why}; {rng.fix}")
    return out
