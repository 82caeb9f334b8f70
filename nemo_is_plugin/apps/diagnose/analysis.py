"""What the training/rollout mismatch of a dump does to each IS setting, binned by response length.

The weights come from the loss's own code: ``loss.correction.compute_is_correction`` (level -> truncation / masking /
rejection, NeMo-RL's handling of non-finite weights) and the mismatch metrics from
``loss.mismatch_metrics.mismatch_metric_sums`` + ``finalize_metrics``. This module only selects tokens and summarises.

Every statistic is over *valid tokens* (mask = 1) of the responses in a bin, i.e. token-weighted, because the loss
applies w_t per token: a sequence-level weight counts once per token of its sequence.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from nemo_is_plugin.apps.diagnose.binning import LengthBin, length_bins
from nemo_is_plugin.apps.diagnose.dump import RolloutDump
from nemo_is_plugin.apps.diagnose.settings import Setting
from nemo_is_plugin.loss.correction import compute_is_correction
from nemo_is_plugin.loss.is_weights import MAX_LOG_WEIGHT
from nemo_is_plugin.loss.layout import TokenLayout
from nemo_is_plugin.loss.mismatch_metrics import finalize_metrics, mismatch_metric_sums
from nemo_is_plugin.loss.terms import is_correction_kwargs

MISMATCH_KEYS = (
    "mismatch_kl_k1",
    "mismatch_kl_k3",
    "log_ppl_diff",
    "log_ppl_abs_diff",
    "training_log_ppl",
    "rollout_log_ppl",
    "chi2_token",
    "chi2_seq",
)


@dataclass
class WeightStats:
    """Summary of the final IS weights over the valid tokens of a group of responses.

    ess: normalised effective sample size (sum w)^2 / (n sum w^2) in [0, 1] (0 when every weight is 0).
    truncated: fraction of tokens whose weight truncation changed (tis clamps).
    masked: fraction of tokens whose final weight is 0 (icepop / sequence masks / rejection / veto).
    saturated: fraction of tokens whose log-weight reached the loss's guard ``MAX_LOG_WEIGHT`` (w = e^30): the
        mismatch is so large that only truncation gives the weight a meaning.
    """

    n_responses: int
    n_tokens: int
    mean: float = float("nan")
    std: float = float("nan")
    min: float = float("nan")
    max: float = float("nan")
    ess: float = float("nan")
    truncated: float = float("nan")
    masked: float = float("nan")
    saturated: float = float("nan")


@dataclass
class SettingResult:
    setting: Setting
    overall: WeightStats
    by_bin: list[WeightStats]
    response_mean: np.ndarray  # float64[B] mean final weight over each response's valid tokens (NaN if none)
    response_log_w: np.ndarray  # float64[B] mean log w of the level (before truncation) per response


@dataclass
class Analysis:
    source: str
    dtype: str
    num_responses: int
    num_tokens: int
    valid_lengths: np.ndarray  # int64[B]
    bins: list[LengthBin]
    mismatch: dict[str, float]  # over all responses
    mismatch_by_bin: list[dict[str, float]]
    settings: list[SettingResult]
    skipped: list[tuple[str, str]] = field(default_factory=list)
    empty_responses: int = 0  # responses without a valid token (not binned)

    def result(self, name: str) -> SettingResult:
        for r in self.settings:
            if r.setting.name == name:
                return r
        raise KeyError(f"no setting named {name!r}; have {[r.setting.name for r in self.settings]}")


def analyze(
    dump: RolloutDump,
    settings: Sequence[Setting],
    *,
    dtype: torch.dtype = torch.float32,
    max_bins: int = 6,
    edges: Sequence[int] | None = None,
    skipped: Sequence[tuple[str, str]] = (),
) -> Analysis:
    """Diagnose ``dump`` for each setting.

    Args:
        dump: the rollout dump (B responses, N tokens).
        settings: the IS settings to compare (see ``settings.settings_grid``).
        dtype: the dtype the loss computes weights in (float32 by default, as the loss).
        max_bins, edges: response-length bins (see ``binning.length_bins``).
    """
    layout = TokenLayout.packed(torch.as_tensor(dump.cu_seqlens))
    prev = torch.as_tensor(dump.prev_logprobs).to(dtype)
    gen = torch.as_tensor(dump.generation_logprobs).to(dtype)
    tmask = torch.as_tensor(dump.mask).to(dtype)
    lengths = dump.valid_lengths
    bins = length_bins(lengths, max_bins=max_bins, edges=edges)
    seq_of_tok = dump.seq_index
    groups = [lengths > 0] + [b.contains(lengths) & (lengths > 0) for b in bins]  # [all, *bins] as bool[B]

    mismatch = [_mismatch(prev, gen, tmask, layout, g, lengths) for g in groups]
    results = []
    for s in settings:
        corr = compute_is_correction(prev, gen, tmask, tmask, layout, **is_correction_kwargs(s.config))
        w = corr.weights.double().numpy()
        trunc = (corr.out_of_band & ~corr.rejected).numpy()
        # explicit IS levels saturate log w at MAX_LOG_WEIGHT instead of overflowing
        saturated = (corr.log_weights >= MAX_LOG_WEIGHT).numpy()
        stats = [_weight_stats(w, trunc, saturated, dump.mask & g[seq_of_tok], int(g.sum())) for g in groups]
        count = np.maximum(lengths, 1)
        resp_mean = np.add.reduceat(np.where(dump.mask, w, 0.0), dump.cu_seqlens[:-1]) / count
        log_w = corr.log_weights.double().numpy()
        resp_log = np.add.reduceat(np.where(dump.mask, log_w, 0.0), dump.cu_seqlens[:-1]) / count
        empty = lengths == 0
        resp_mean[empty], resp_log[empty] = np.nan, np.nan
        results.append(SettingResult(s, stats[0], stats[1:], resp_mean, resp_log))
    return Analysis(
        source=dump.source,
        dtype=str(dtype).removeprefix("torch."),
        num_responses=dump.num_responses,
        num_tokens=dump.num_tokens,
        valid_lengths=lengths,
        bins=bins,
        mismatch=mismatch[0],
        mismatch_by_bin=mismatch[1:],
        settings=results,
        skipped=list(skipped),
        empty_responses=int((lengths == 0).sum()),
    )


def _mismatch(
    prev: torch.Tensor, gen: torch.Tensor, tmask: torch.Tensor, layout: TokenLayout, group: np.ndarray, lengths
) -> dict[str, float]:
    """The loss's mismatch metrics over the responses in ``group`` (bool[B]): sample_mask selects them."""
    sample_mask = torch.as_tensor(group, dtype=prev.dtype)
    n_tok = float(lengths[group].sum())
    n_seq = float(group.sum())
    sums = mismatch_metric_sums(prev, gen, tmask, sample_mask, layout, n_tok, n_seq)
    out = finalize_metrics({k: float(v) for k, v in sums.items()})
    valid = (tmask != 0) & (layout.to_tokens(sample_mask) != 0)
    diff = torch.where(valid, (prev - gen).double().abs(), torch.zeros((), dtype=torch.float64))
    metrics = {k: out[k] for k in MISMATCH_KEYS if k in out}
    metrics["max_abs_log_ratio"] = float(diff.max()) if diff.numel() else 0.0
    metrics["responses"], metrics["tokens"] = n_seq, n_tok
    return metrics


def _weight_stats(
    w: np.ndarray, truncated: np.ndarray, saturated: np.ndarray, select: np.ndarray, n_responses: int
) -> WeightStats:
    """Stats of w[select] (float64[N] weights, bool[N] masks)."""
    n = int(select.sum())
    if n == 0:
        return WeightStats(n_responses, 0)
    v = w[select]
    top = float(v.max())
    # scale by the max so that sums of squares cannot overflow even for float64 weights near 1e308
    s = v / top if top > 0 else v
    mean_s = float(s.mean())
    ess = float(s.sum() ** 2 / (n * np.square(s).sum())) if top > 0 else 0.0
    std = top * float(s.std()) if top > 0 else 0.0  # two-pass: no cancellation when the weights are all ~equal
    return WeightStats(
        n_responses=n_responses,
        n_tokens=n,
        mean=top * mean_s if top > 0 else 0.0,
        std=std,
        min=float(v.min()),
        max=top,
        ess=ess,
        truncated=float(truncated[select].mean()),
        masked=float((v == 0).mean()),
        saturated=float(saturated[select].mean()),
    )
