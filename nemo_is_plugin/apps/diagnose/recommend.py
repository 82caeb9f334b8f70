"""Pick an IS setting for a dump, and say why.

Rule: among the settings whose weights are *healthy* in every response-length bin, take the least biased one.

Healthy (per bin with at least ``min_responses`` responses; thresholds in :class:`Criteria`):
- effective sample size >= ``min_ess``: the weights do not concentrate the gradient on a few tokens;
- mean weight within ``mean_band``: the correction does not silently rescale the learning rate (NeMo-RL PR #2269
  saw sequence weights with mean 0.4 and steps at 0.02 on 9k-token responses);
- masked fraction <= ``max_masked`` and truncated fraction <= ``max_truncated``: little data thrown away / biased;
- largest weight <= ``max_weight``: no single token dominates a batch.

Least biased first (``LEVEL_ORDER``): cumulative (unbiased prefix correction per token, lower variance than the
sequence weight: CTPO), sequence (unbiased for the whole response, variance grows like (1+chi2)^L), token (ignores
the prefix), sequence_mean (one geometric-mean scale per response: stable but corrects no individual token).
Within a level, less intervention first (``TRUNCATION_ORDER``): none, tis, icepop, then sequence masks/rejection.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from nemo_is_plugin.apps.diagnose.analysis import Analysis, SettingResult, WeightStats

# Why a chi-square estimate E[w^2] - 1 can come out below its floor 0, and how to read it.
CHI2_BELOW_FLOOR = (
    "a chi-square estimate E[w^2] - 1 below 0, while the divergence itself is >= 0. E[w^2] >= E[w]^2, so this happens "
    "only when the sample's mean weight is below 1: the sample has not seen the weights' rare large values, which "
    "carry E[w] = 1. Read it as 'not resolved by this sample', not as 'no mismatch'."
)
LEVEL_ORDER = ("cumulative", "sequence", "token", "sequence_mean")
TRUNCATION_ORDER = ("none", "tis", "icepop", "seq-mask-tis", "geo-rs", "seq-mis")
_WHY_LEVEL = {
    "cumulative": "cumulative weights are an unbiased prefix correction for every token, with lower variance than "
    "the whole-sequence weight (CTPO)",
    "sequence": "the sequence weight is the unbiased correction of the whole response",
    "token": "token weights stay near 1 at every length (they ignore the prefix, which biases them slightly)",
    "sequence_mean": "the geometric-mean weight is stable at any length (it rescales each response, no token)",
}


@dataclass(frozen=True)
class Criteria:
    """Thresholds of the rule above. ``min_sample``: below this many responses (with a valid token) the
    recommendation is flagged tentative. A sequence-level weight is one value per response, so its mean has a
    standard error std / sqrt(n); long responses spread those weights with a std up to ~0.7 (the demo's exp(sum)
    weights at 1024 tokens), and 32 responses put that error at ~0.12: the judged band edge 0.5 is then four standard
    errors from the ideal 1, and the ESS, which cannot go below 1/n, resolves 0.03 against its threshold 0.5."""

    min_ess: float = 0.5
    mean_band: tuple[float, float] = (0.5, 2.0)
    max_masked: float = 0.10
    max_truncated: float = 0.20
    max_weight: float = 10.0
    min_responses: int = 4
    min_sample: int = 32


DEFAULT_CRITERIA = Criteria()


@dataclass
class Recommendation:
    """The chosen setting (``name``), whether it meets every criterion (``ok``), the reasons, and per setting the
    checks it failed (empty list = healthy)."""

    name: str
    ok: bool
    loss_fn: dict
    reasons: list[str]
    failures: dict[str, list[str]] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)

    @property
    def tentative(self) -> bool:
        return bool(self.warnings)

    def yaml(self) -> str:
        """The recommended ``loss_fn`` section as YAML, ready to paste into a config (validates unchanged)."""
        import yaml

        return yaml.safe_dump({"loss_fn": dict(self.loss_fn)}, sort_keys=False, default_flow_style=False)


def check(result: SettingResult, analysis: Analysis, criteria: Criteria) -> list[str]:
    """The criteria ``result`` fails, as readable strings naming the bin; [] when healthy."""
    groups = _judged_groups(result, analysis, criteria)
    out: list[str] = []
    c = criteria
    for label, st in groups:
        if st.ess < c.min_ess:
            out.append(f"ESS {st.ess:.2f} < {c.min_ess:g} at length {label}")
        if not c.mean_band[0] <= st.mean <= c.mean_band[1]:
            out.append(f"mean weight {st.mean:.3g} outside [{c.mean_band[0]:g}, {c.mean_band[1]:g}] at length {label}")
        if st.masked > c.max_masked:
            out.append(f"{st.masked:.1%} of tokens masked (> {c.max_masked:.0%}) at length {label}")
        if st.truncated > c.max_truncated:
            out.append(f"{st.truncated:.1%} of tokens truncated (> {c.max_truncated:.0%}) at length {label}")
    if result.overall.max > c.max_weight:
        out.append(f"max weight {result.overall.max:.3g} > {c.max_weight:g}")
    return out


def recommend(analysis: Analysis, criteria: Criteria | None = None) -> Recommendation:
    """Apply the rule of the module docstring to every analysed setting."""
    c = criteria or DEFAULT_CRITERIA
    if not analysis.settings:
        raise ValueError("no settings were analysed; nothing to recommend")
    failures = {r.setting.name: check(r, analysis, c) for r in analysis.settings}
    ranked = sorted(analysis.settings, key=_rank)
    healthy = [r for r in ranked if not failures[r.setting.name]]
    notes = _mismatch_notes(analysis)
    warnings = _sample_warnings(analysis, c)
    if healthy:
        best = healthy[0]
        reasons = [_why_healthy(best, analysis, c), _WHY_LEVEL[best.setting.level] + "."]
        for r in ranked:
            if r is best:
                break
            reasons.append(f"not {r.setting.name}: {failures[r.setting.name][0]}")
        return Recommendation(best.setting.name, True, best.setting.loss_fn_keys(), reasons + notes, failures, warnings)
    # Nothing healthy: the setting that keeps the most effective data in its worst bin.
    best = max(ranked, key=lambda r: _score(r, analysis, c))
    reasons = [
        "no setting meets every criterion: the mismatch is severe. Check the rollout engine first (precision of "
        "the sampler's log-probs, kernel differences, MoE routing replay) before relying on IS.",
        f"{best.setting.name} keeps the most effective data in its worst length bin; it fails: "
        + "; ".join(failures[best.setting.name][:3]),
    ]
    return Recommendation(best.setting.name, False, best.setting.loss_fn_keys(), reasons + notes, failures, warnings)


def _sample_warnings(analysis: Analysis, c: Criteria) -> list[str]:
    n = analysis.num_responses - analysis.empty_responses
    if n >= c.min_sample:
        return []
    return [
        f"only {n} response(s) with a valid token (fewer than {c.min_sample}): the weight statistics are too noisy "
        "to tell the settings apart (a sequence-level mean weight has a standard error of std / sqrt(n)), so this "
        "recommendation is tentative; dump more rollouts (several steps) and run diagnose again."
    ]


# -------------------------------------------------------------------------------------------------- helpers
def _judged_groups(result: SettingResult, analysis: Analysis, c: Criteria) -> list[tuple[str, WeightStats]]:
    """Bins with enough responses to judge; the whole dump when no bin has enough."""
    groups = [(b.label, st) for b, st in zip(analysis.bins, result.by_bin) if st.n_responses >= c.min_responses]
    if not groups and result.overall.n_tokens:
        groups = [("all", result.overall)]
    return [(label, st) for label, st in groups if st.n_tokens]


def _rank(r: SettingResult) -> tuple[int, int, int]:
    s = r.setting
    level = LEVEL_ORDER.index(s.level) if s.level in LEVEL_ORDER else len(LEVEL_ORDER)
    trunc = TRUNCATION_ORDER.index(s.truncation) if s.truncation in TRUNCATION_ORDER else len(TRUNCATION_ORDER)
    return level, trunc, int(s.config.importance_sampling_veto_threshold is not None)


def _score(r: SettingResult, analysis: Analysis, c: Criteria) -> float:
    groups = _judged_groups(r, analysis, c)
    if not groups:
        return float("-inf")
    return min(st.ess * (1.0 - st.masked) for _, st in groups)


def _why_healthy(r: SettingResult, analysis: Analysis, c: Criteria) -> str:
    groups = _judged_groups(r, analysis, c)
    ess = min(st.ess for _, st in groups)
    lo, hi = min(st.mean for _, st in groups), max(st.mean for _, st in groups)
    masked = max(st.masked for _, st in groups)
    trunc = max(st.truncated for _, st in groups)
    where = "the whole dump" if groups[0][0] == "all" else f"every length bin with >= {c.min_responses} responses"
    return (
        f"{r.setting.name} is healthy in {where}: ESS >= {ess:.2f}, mean weight {lo:.3g}-{hi:.3g}, "
        f"<= {masked:.1%} masked, <= {trunc:.1%} truncated, max weight {r.overall.max:.3g}."
    )


def _mismatch_notes(analysis: Analysis) -> list[str]:
    m = analysis.mismatch
    notes = []
    k3 = m.get("mismatch_kl_k3", float("nan"))
    if k3 == k3 and k3 < 1e-4:
        notes.append(f"the mismatch is small (k3 KL {k3:.2g} per token): the levels differ little.")
    chi2_seq = m.get("chi2_seq", float("nan"))
    if chi2_seq != chi2_seq or chi2_seq > 1.0:
        notes.append(
            f"chi2_seq = {chi2_seq:.3g}: whole-sequence weights have a heavy tail (variance grows like (1+chi2)^L)."
        )
    elif chi2_seq < 0:
        notes.append(f"chi2_seq = {chi2_seq:.3g} < 0: {CHI2_BELOW_FLOOR}")
    if analysis.empty_responses:
        notes.append(f"{analysis.empty_responses} response(s) have no unmasked token and were left out.")
    return notes
