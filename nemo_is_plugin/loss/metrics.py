"""The loss's metrics: NeMo-RL's names and values, plus the IS, clip and mismatch statistics practitioners log.

Every metric is this process's additive share (a local sum over a global count); names ending in ``_min`` / ``_max`` are
reduced with min / max. NeMo-RL's metrics are computed in the loss's dtype with NeMo-RL's normalisation, ``sum(v * m) /
(N + 1e-8)``, so that they carry NeMo-RL's exact values (1.0 where NeMo-RL reports 1.0, not the 0.9999999967 of a
float64 division; the book's ``nemo_rl_*`` means); the plugin's own metrics are accumulated in float64. Under context
parallelism :meth:`MetricBook.finish` reduces the shares over the CP group in one collective, so each CP rank returns
the full-sequence metrics.

Each metric declares, where it is emitted, the global count it was divided by (:class:`Denominator`: the token count,
the sequence count, or none for extrema, raw counts and local means). A host that calls the loss with placeholder
counts (NeMo-RL's split API) or averages per-micro-batch metrics (verl) rescales each metric by that count; the
returned :class:`MetricValues` carry the declarations next to the values.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from nemo_is_plugin.loss.correction import ISCorrection
from nemo_is_plugin.loss.denominator import Denominator
from nemo_is_plugin.loss.kl import kl_estimate
from nemo_is_plugin.loss.layout import TokenLayout
from nemo_is_plugin.loss.masked import EPS, where_mask
from nemo_is_plugin.loss.mismatch_metrics import POSITION_BUCKETS, bucket_names, mismatch_metric_sums_by_count
from nemo_is_plugin.loss.objectives import SurrogateOut


def aggregation_denominator(aggregation: str) -> Denominator:
    """The count a loss aggregated with ``aggregation`` (``loss_aggregation``) is divided by."""
    if aggregation == "token-sum":
        return Denominator.NONE  # a plain sum
    return Denominator.TOKENS if aggregation == "token-mean" else Denominator.SEQUENCES


class MetricValues(dict[str, float]):
    """The loss's metrics, name -> value, with ``denominators``: name -> the :class:`Denominator` it was divided by."""

    def __init__(self, values: Mapping[str, float], denominators: Mapping[str, Denominator]):
        super().__init__(values)
        self.denominators = dict(denominators)


class MetricBook:
    """Collects metric tensors during one loss call and turns them into floats at the end (one host sync).

    Token means and extrema are deferred to :meth:`finish` and computed together, one ``[K, N]`` masked reduction per
    mask (and dtype), instead of several small ops each: on a GPU the loss's epilogue on ``[N]`` vectors is bound by
    kernel launches, not by arithmetic (docs/gpu_runs.md); the benchmark configuration's epilogue went from 716 to 472
    kernel-launching ops (counted on CPU). Every metric is added with its :class:`Denominator`. A book of meta tensors
    (a shape-only trace of the loss, see
    :meth:`~nemo_is_plugin.loss.clipped_pg.ClippedPGLoss.metric_denominators`) has names and denominators, no values.
    """

    def __init__(self, layout: TokenLayout, valid: torch.Tensor, n_tok: torch.Tensor, n_seq: torch.Tensor):
        self.layout, self.valid, self.n_tok, self.n_seq = layout, valid, n_tok, n_seq
        self.sums: dict[str, torch.Tensor] = {}
        self.mins: dict[str, torch.Tensor] = {}
        self.maxs: dict[str, torch.Tensor] = {}
        self.denominators: dict[str, Denominator] = {}
        # deferred reductions, grouped by the mask object (kept alive here, so its id is not reused) and, for means,
        # whether they are NeMo-RL's (in the loss dtype): (id(mask), nemo_rl) or id(mask) -> (mask, [(name, values)]);
        # the names hold their places in the tables
        self._means: dict[tuple[int, bool], tuple[torch.Tensor, list[tuple[str, torch.Tensor]]]] = {}
        self._extrema: dict[int, tuple[torch.Tensor, list[tuple[str, torch.Tensor]]]] = {}
        self._valid_bool = valid != 0  # min_max's mask: one tensor, so its extrema share one group

    # ------------------------------------------------------------------ primitives
    def add_sum(self, name: str, value: torch.Tensor, per: Denominator) -> None:
        """A local additive share of a value divided by the global count ``per``."""
        self.sums[name] = value.detach().double().reshape(())
        self.denominators[name] = per

    def add_replicated_scalar(self, name: str, value: torch.Tensor, per: Denominator) -> None:
        """A value every CP rank holds in full (e.g. computed from per-sequence sums)."""
        self.add_sum(name, self.layout.replicated_share(value.detach().double()), per)

    def token_mean(self, name: str, values: torch.Tensor, mask: torch.Tensor | None = None) -> None:
        """``sum(values * mask) / (N + eps)`` in float64 (``mask``: the valid tokens by default), at the end."""
        self._defer_mean(name, values, self.valid if mask is None else mask, nemo_rl=False)

    def seq_mean(self, name: str, per_seq: torch.Tensor, sample_mask: torch.Tensor) -> None:
        value = where_mask(per_seq.double(), sample_mask).sum() / (self.n_seq.double() + EPS)
        self.add_replicated_scalar(name, value, Denominator.SEQUENCES)

    def nemo_rl_token_mean(self, name: str, values: torch.Tensor) -> None:
        """NeMo-RL's ``masked_mean(v, mask, global_valid_toks)`` in the loss dtype (its exact value), computed at the
        end."""
        self._defer_mean(name, values, self.valid, nemo_rl=True)

    def _defer_mean(self, name: str, values: torch.Tensor, mask: torch.Tensor, nemo_rl: bool) -> None:
        self._means.setdefault((id(mask), nemo_rl), (mask, []))[1].append((name, values.detach()))
        self.sums[name] = values  # a placeholder keeping the metric's place; replaced by _compute_means
        self.denominators[name] = Denominator.TOKENS

    def _compute_means(self) -> None:
        """Every deferred token mean: per (mask, dtype) group one stacked masked sum over the token dimension."""
        for (_, nemo_rl), (mask, items) in self._means.items():
            dtype = self.n_tok.dtype if nemo_rl else torch.float64
            stacked = _stack_broadcast([v.to(dtype) for _, v in items], mask)
            count = self.n_tok if nemo_rl else self.n_tok.double()
            means = (where_mask(stacked, mask).flatten(1).sum(-1) / (count + EPS)).double()
            for i, (name, _) in enumerate(items):
                self.sums[name] = means[i]
        self._means.clear()

    def nemo_rl_seq_mean(self, name: str, per_seq: torch.Tensor, sample_mask: torch.Tensor) -> None:
        """NeMo-RL's ``masked_mean(v, sample_mask, global_valid_seqs)`` of a per-sequence value, in the loss dtype."""
        v = per_seq.detach().to(self.n_seq.dtype)
        value = where_mask(v, sample_mask).sum() / (self.n_seq + EPS)
        self.add_replicated_scalar(name, value, Denominator.SEQUENCES)

    def extrema(self, name: str, values: torch.Tensor, valid: torch.Tensor) -> None:
        """``<name>_min`` / ``<name>_max`` of ``values`` where ``valid`` (reduced with min / max, never rescaled;
        +inf / -inf where nothing is valid), computed at the end with the other extrema over the same ``valid``."""
        self._extrema.setdefault(id(valid), (valid, []))[1].append((name, values.detach()))
        self.mins[f"{name}_min"] = self.maxs[f"{name}_max"] = values  # placeholders keeping their places
        self.denominators[f"{name}_min"] = self.denominators[f"{name}_max"] = Denominator.NONE

    def min_max(self, name: str, values: torch.Tensor) -> None:
        self.extrema(name, values, self._valid_bool)

    def _compute_extrema(self) -> None:
        for valid, items in self._extrema.values():
            stacked = _stack_broadcast([v.double() for _, v in items], valid)
            lows = torch.where(valid, stacked, float("inf")).flatten(1).amin(-1)
            highs = torch.where(valid, stacked, float("-inf")).flatten(1).amax(-1)
            for i, (name, _) in enumerate(items):
                self.mins[f"{name}_min"], self.maxs[f"{name}_max"] = lows[i], highs[i]
        self._extrema.clear()

    # ------------------------------------------------------------------ metric groups
    def policy_ratio(self, ratio: torch.Tensor | None, clipped_ratio: torch.Tensor | None) -> None:
        """NeMo-RL's ``probs_ratio`` / ``probs_ratio_clamped`` (means and extrema) of the ratios :func:`nemo_rl_ratios`
        gives, each only where there is one."""
        ratios = [
            (name, r) for name, r in (("probs_ratio", ratio), ("probs_ratio_clamped", clipped_ratio)) if r is not None
        ]
        for name, r in ratios:
            self.nemo_rl_token_mean(name, r)
        for name, r in ratios:
            self.min_max(name, r)

    def clip_fractions(self, sur: SurrogateOut) -> None:
        """The share of tokens each of the objective's clip indicators marks (none for an indicator it has not)."""
        for name, flag in (
            ("clip_fraction", sur.clipped),
            ("clip_fraction_low", sur.clipped_low),
            ("clip_fraction_high", sur.clipped_high),
            ("clip_fraction_dual", sur.dual_clipped),
        ):
            if flag is not None:
                self.token_mean(name, flag.double())

    def importance_weights(
        self,
        corr: ISCorrection,
        w_metric: torch.Tensor,
        truncation: str | None,
        nemo_rl_gspo_broadcast: bool,
        sample_mask: torch.Tensor,
    ) -> None:
        """``w_metric`` are the weights NeMo-RL reports (after truncation, even when IS correction is off).
        ``nemo_rl_gspo_broadcast``: NeMo-RL's GSPO weights (``sequence_level_importance_ratios`` without an explicit
        level), whose ``sampling_importance_ratio`` NeMo-RL computes with a broadcast of its own (below)."""
        if nemo_rl_gspo_broadcast:
            # NeMo-RL's broadcast of [B, 1] weights against the [B] sample mask: sum_i w_i * sum_j s_j / N_seq, over
            # every row i, masked or not. The sequence weight is constant along its row, padding included.
            seq_w = self.layout.seq_max(w_metric).to(self.n_seq.dtype)
            seq_w = torch.where(torch.isfinite(seq_w), seq_w, torch.zeros_like(seq_w))
            broadcast = (seq_w.unsqueeze(1) * sample_mask.to(seq_w.dtype).unsqueeze(0)).sum() / (self.n_seq + EPS)
            self.add_replicated_scalar("sampling_importance_ratio", broadcast, Denominator.SEQUENCES)
        else:
            self.nemo_rl_token_mean("sampling_importance_ratio", w_metric)
        # The corrected value: mean over sequences of each sequence's masked mean weight (its weight, for sequence
        # levels); independent of padding.
        count = self.layout.seq_sum(self.valid.double())
        per_seq = self.layout.seq_sum(where_mask(w_metric.double(), self.valid)) / (count + EPS)
        self.seq_mean("sampling_importance_ratio_seq_mean", per_seq, sample_mask)
        if truncation is not None:
            if corr.seq_out_of_band is not None:
                self.nemo_rl_seq_mean("is_oob_ratio", corr.seq_out_of_band, sample_mask)
            else:
                self.nemo_rl_token_mean("is_oob_ratio", corr.out_of_band)
        for prefix, w in (("is_weight", corr.weights), ("is_raw_weight", corr.raw_weights)):
            self.token_mean(f"{prefix}_mean", w)
            self.token_mean(f"{prefix}_sq_mean", w.double() ** 2)
            self.min_max(prefix, w)
        self.token_mean("is_truncated_fraction", (corr.out_of_band & ~corr.rejected).double())
        self.token_mean("is_rejected_fraction", corr.rejected.double())
        rejected_seq = self.layout.seq_max(where_mask(corr.rejected.double(), self.valid)) > 0
        self.seq_mean("is_rejected_seq_fraction", rejected_seq.double(), sample_mask)

    def rejection_rules(self, corr: ISCorrection, sample_mask: torch.Tensor) -> None:
        """Per rejection rule ``is_rejection_<rule>_``: ``mean`` (token mean of the statistic, a sequence's value on
        each of its tokens), ``min`` / ``max`` (over valid tokens, or valid sequences for sequence rules),
        ``rejected_fraction`` / ``rejected_seq_fraction`` (valid tokens it rejects / sequences where it rejects one);
        and the two fractions of all rules together under ``is_rejection_``."""
        if corr.rules_keep is None:
            return
        seq_valid = (self.layout.seq_sum(self.valid.double()) > 0) & (sample_mask != 0)
        for rule in corr.rules:
            prefix = f"is_rejection_{rule.name}"
            self.token_mean(f"{prefix}_mean", rule.token_stat)
            if rule.seq_stat is None:
                self.min_max(prefix, rule.token_stat)
            else:
                self.extrema(prefix, rule.seq_stat, seq_valid)
            self._rejected(prefix, ~rule.keep, sample_mask)
        self._rejected("is_rejection", ~corr.rules_keep, sample_mask)

    def _rejected(self, prefix: str, rejected: torch.Tensor, sample_mask: torch.Tensor) -> None:
        self.token_mean(f"{prefix}_rejected_fraction", rejected.double())
        rejected_seq = self.layout.seq_max(where_mask(rejected.double(), self.valid)) > 0
        self.seq_mean(f"{prefix}_rejected_seq_fraction", rejected_seq.double(), sample_mask)

    def mismatch(self, prev, gen, token_mask, sample_mask) -> None:
        token_means, seq_means = mismatch_metric_sums_by_count(
            prev, gen, token_mask, sample_mask, self.layout, self.n_tok, self.n_seq
        )
        for name, value in token_means.items():
            self.add_sum(name, value, Denominator.TOKENS)
        for name, value in seq_means.items():
            self.add_sum(name, value, Denominator.SEQUENCES)

    def clip_by_position(self, sur: SurrogateOut, positions: torch.Tensor) -> None:
        """The clipped (or dual-clipped) share of the tokens by position bucket; nothing for an objective that clips
        nothing."""
        flags = [flag for flag in (sur.clipped, sur.dual_clipped) if flag is not None]
        if not flags:
            return
        clipped = (flags[0] if len(flags) == 1 else flags[0] | flags[1]).double()
        edges = list(POSITION_BUCKETS) + [float("inf")]
        for name, lo, hi in zip(bucket_names(), edges[:-1], edges[1:]):
            in_bucket = ((positions >= lo) & (positions < hi)).double()
            self.token_mean(f"clip_frac/pos_{name}", clipped * in_bucket)
            self.token_mean(f"token_frac/pos_{name}", in_bucket)

    # ------------------------------------------------------------------ end
    def finish(self) -> MetricValues:
        return self.finish_reading(None)[0]

    def finish_reading(self, read_with: Mapping[str, torch.Tensor] | None) -> tuple[MetricValues, dict[str, float]]:
        """The metrics, and a caller's own 0-d tensors ``read_with`` (not metrics: returned apart and not reduced over
        CP), read from the device together: the call's one host synchronisation."""
        return self.read(*self.stacked(read_with))

    def stacked(self, read_with: Mapping[str, torch.Tensor] | None) -> tuple[list[str], list[str], torch.Tensor | None]:
        """Every deferred reduction done and the values stacked in one float64 vector, still on the device (no host
        read): (metric names, ``read_with``'s names, the values in that order; None without any). The compiled
        epilogue (``loss/compiled.py``) returns this vector from its graph and reads it with :meth:`read`."""
        self._compute_means()
        self._compute_extrema()
        names: list[str] = []
        parts: list[torch.Tensor] = []
        for table, reduce in (
            (self.sums, self.layout.reduce_metric_sums),
            (self.mins, self.layout.reduce_metric_min),
            (self.maxs, self.layout.reduce_metric_max),
        ):
            if table:
                names.extend(table)
                parts.append(reduce(torch.stack(list(table.values()))))
        own = list(read_with or {})
        if own and read_with is not None:
            parts.append(torch.stack([read_with[k].detach().double().reshape(()) for k in own]))
        return names, own, torch.cat(parts) if parts else None

    def read(
        self, names: list[str], own: list[str], values: torch.Tensor | None, *, host: list[float] | None = None
    ) -> tuple[MetricValues, dict[str, float]]:
        """:meth:`stacked`'s vector read on the host: the metrics and the caller's own values. ``host``: the vector's
        values when the caller read them already (with more values of its own, in the same synchronisation)."""
        if values is None:
            return MetricValues({}, {}), {}
        if values.device.type == "meta":  # a shape-only trace: no values to read
            return MetricValues(dict.fromkeys(names, math.nan), self.denominators), dict.fromkeys(own, math.nan)
        read = values.tolist() if host is None else host  # the call's one host sync
        return MetricValues(dict(zip(names, read)), self.denominators), dict(zip(own, read[len(names) :]))


def nemo_rl_ratios(
    sur: SurrogateOut, curr: torch.Tensor, nemo_rl_switch: str | None
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The ratio and clipped ratio that ``probs_ratio`` / ``probs_ratio_clamped`` report: the objective's own (None
    where it has none). Where a NeMo-RL switch selected the objective (``use_cispo``, ``disable_ppo_ratio``,
    ``force_on_policy_ratio``: ``nemo_rl_switch``), NeMo-RL's ``ClippedPGLossFn`` reports both always, and so does the
    loss, with NeMo-RL's values: its ``ratios`` are the log-probs ``curr`` under ``disable_ppo_ratio``, and its
    ``ratios_clamped`` are its ``ratios`` where it clamps nothing (NVIDIA-NeMo/RL
    ``nemo_rl/algorithms/loss/loss_functions.py`` @ 7ea279ab)."""
    if nemo_rl_switch is None:
        return sur.ratio, sur.clipped_ratio
    ratio = curr.detach() if sur.ratio is None else sur.ratio
    return ratio, ratio if sur.clipped_ratio is None else sur.clipped_ratio


def _stack_broadcast(values: list[torch.Tensor], mask: torch.Tensor) -> torch.Tensor:
    """``[K, *shape]``: the values broadcast with the mask to one shape (a layout may hand ``[1, N]`` next to ``[N]``),
    as the per-metric ``where_mask(v, mask)`` broadcast each of them."""
    shape = torch.broadcast_shapes(mask.shape, *(v.shape for v in values))
    return torch.stack([v.expand(shape) for v in values])


@torch.no_grad()
def nemo_rl_error_metrics(book: MetricBook, prev: torch.Tensor, gen: torch.Tensor, valid: torch.Tensor, kl_type: str):
    """NeMo-RL's mismatch metrics: token_mult_prob_error, gen_kl_error, policy_kl_error, js_divergence_error.

    The KL errors use ``reference_policy_kl_type`` without clamps, even when the KL penalty is 0 (NeMo-RL's
    behaviour); the Jensen-Shannon error is 0.5 (k3(p - M) + k3(g - M)) with M = log((e^p + e^g) / 2).
    """
    book.nemo_rl_token_mean("token_mult_prob_error", torch.exp(where_mask((gen - prev).abs(), valid)))
    book.nemo_rl_token_mean("gen_kl_error", kl_estimate(prev - gen, kl_type))
    book.nemo_rl_token_mean("policy_kl_error", kl_estimate(gen - prev, kl_type))
    # M = log((e^p + e^g) / 2), computed as NeMo-RL does (its exact value); where that underflows (both log-probs
    # below about -103 in float32: log 0 = -inf, then NaN) the stable logaddexp form takes over.
    mix = torch.log(0.5 * torch.exp(prev) + 0.5 * torch.exp(gen))
    stable = torch.logaddexp(prev, gen) - math.log(2.0)
    mix = torch.where(torch.isfinite(mix) | ~torch.isfinite(stable), mix, stable)
    # k3-shaped whatever the KL type, in NeMo-RL's order of operations: 0.5 (e^a - a - 1) + 0.5 (e^b - b - 1).
    a, b = prev - mix, gen - mix
    js = 0.5 * (torch.exp(a) - a - 1) + 0.5 * (torch.exp(b) - b - 1)
    book.nemo_rl_token_mean("js_divergence_error", js)
