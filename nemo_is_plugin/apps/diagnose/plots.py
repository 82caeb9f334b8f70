"""PNG plots of an :class:`Analysis`: log-weight vs response length per level, and per-bin ESS / mean / masked.

Uses matplotlib's object API with the Agg canvas (no pyplot, no global backend change), so it is safe to call
from a notebook or a headless job.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from nemo_is_plugin.apps.diagnose.analysis import Analysis
from nemo_is_plugin.apps.diagnose.settings import IS_LEVELS

_LEVEL_COLORS = {"token": "tab:blue", "sequence": "tab:red", "sequence_mean": "tab:green", "cumulative": "tab:purple"}
_LEVEL_MARKERS = {"token": "o", "sequence": "s", "sequence_mean": "^", "cumulative": "D"}
_DODGE = 0.3  # total horizontal spread of the settings within one length bin (bins are 1 apart)
_TRUNC_STYLES = {
    "none": "-",
    "tis": "--",
    "icepop": ":",
    "seq-mask-tis": "-.",
    "seq-mis": (0, (5, 1)),
    "geo-rs": (0, (1, 1)),
}


def _figure(width: float, height: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def plot_weights_vs_length(a: Analysis, path: str | Path) -> Path:
    """One panel per IS level: each response's mean log w (before truncation) against its length.

    log w rather than w: sequence weights span hundreds of orders of magnitude on long responses; the log is
    finite, symmetric and shows the linear drift sum_t (p_t - g_t) directly. The legend names every mark: dots are
    responses, the black line joins each length bin's median, dashed lines are w = 2 and w = 1/2, the grey line w = 1.
    """
    levels = [lv for lv in IS_LEVELS if any(r.setting.level == lv for r in a.settings)]
    fig = _figure(3.6 * max(len(levels), 1), 3.8)
    axes = fig.subplots(1, max(len(levels), 1), squeeze=False)[0]
    lengths = a.valid_lengths
    ok = lengths > 0
    for ax, level in zip(axes, levels):
        r = next(r for r in a.settings if r.setting.level == level)  # log w does not depend on truncation
        y = r.response_log_w[ok]
        ax.scatter(lengths[ok], y, s=9, alpha=0.6, color=_LEVEL_COLORS[level], edgecolors="none", label="one response")
        _binned_median(ax, a, r.response_log_w, color="black")
        for ref, label in ((math.log(2.0), "w = 2 and w = 1/2"), (math.log(0.5), None)):
            ax.axhline(ref, color="gray", linestyle="--", linewidth=0.8, label=label)
        ax.axhline(0.0, color="gray", linewidth=0.6, label="w = 1 (no mismatch)")
        ax.set_xscale("log")
        ax.set_title(f"{level}")
        ax.set_xlabel("response length (valid tokens)")
        ax.set_ylabel("mean log w per response")
    if levels:
        fig.legend(*axes[0].get_legend_handles_labels(), loc="outside lower center", ncol=4, fontsize=8)
    fig.suptitle(f"IS log-weight vs response length ({a.num_responses} responses)")
    return _save(fig, path)


def _binned_median(ax, a: Analysis, per_response: np.ndarray, color: str) -> None:
    xs, ys = [], []
    for b in a.bins:
        sel = b.contains(a.valid_lengths) & np.isfinite(per_response)
        if sel.any():
            xs.append(float(np.exp(np.mean(np.log(a.valid_lengths[sel])))))
            ys.append(float(np.median(per_response[sel])))
    if xs:
        ax.plot(xs, ys, color=color, marker="o", linewidth=1.2, label="median of a length bin")


def plot_bins(a: Analysis, path: str | Path) -> Path:
    """Three panels over the length bins: ESS, mean weight (log scale), fraction of tokens masked; one line each."""
    fig = _figure(13.0, 4.2)
    ax_ess, ax_mean, ax_mask = fig.subplots(1, 3)
    x = np.arange(len(a.bins))
    n = len(a.settings)
    for i, r in enumerate(a.settings):
        # settings with equal values (token and sequence_mean weights both sit at 1 for a small mismatch) would hide
        # each other: each gets its own small horizontal offset, a marker per level and an open face
        xi = x + (_DODGE * (i / (n - 1) - 0.5) if n > 1 else 0.0)
        color = _LEVEL_COLORS.get(r.setting.level, "black")
        style = dict(
            color=color,
            linestyle=_TRUNC_STYLES.get(r.setting.truncation, "-"),
            marker=_LEVEL_MARKERS.get(r.setting.level, "o"),
            markersize=5,
            markerfacecolor="none",
            markeredgecolor=color,
            linewidth=1.2,
            alpha=0.9,
        )
        ess = [st.ess for st in r.by_bin]
        mean = [st.mean if st.mean > 0 else np.nan for st in r.by_bin]
        masked = [st.masked for st in r.by_bin]
        ax_ess.plot(xi, ess, label=r.setting.name, **style)
        ax_mean.plot(xi, mean, **style)
        ax_mask.plot(xi, masked, **style)
    labels = [b.label for b in a.bins]
    for ax, title in (
        (ax_ess, "effective sample size (1 = uniform)"),
        (ax_mean, "mean weight"),
        (ax_mask, "fraction of tokens masked"),
    ):
        ax.set_xticks(x, labels, rotation=30)
        ax.set_xlabel("response length (valid tokens)")
        ax.set_title(title)
    ax_ess.set_ylim(-0.02, 1.02)
    ax_mask.set_ylim(-0.02, 1.02)
    ax_mean.set_yscale("log")
    ax_mean.axhline(1.0, color="gray", linewidth=0.6)
    fig.legend(*ax_ess.get_legend_handles_labels(), loc="outside right center", fontsize=7)
    fig.suptitle(
        "IS weights by response length (colour and marker: level; line style: truncation; the settings "
        "are offset within each bin so that equal values stay visible)",
        fontsize=10,
    )
    return _save(fig, path)


def _save(fig, path: str | Path) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(p)
    return p


def write_plots(a: Analysis, out_dir: str | Path, prefix: str = "diagnose") -> list[Path]:
    """Write ``<prefix>_weights_vs_length.png`` and ``<prefix>_bins.png`` into ``out_dir``; returns the paths."""
    d = Path(out_dir)
    return [
        plot_weights_vs_length(a, d / f"{prefix}_weights_vs_length.png"),
        plot_bins(a, d / f"{prefix}_bins.png"),
    ]
