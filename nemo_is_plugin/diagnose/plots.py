"""PNG plots of an :class:`Analysis`: log-weight vs response length per level, and per-bin ESS / mean / masked.

Uses matplotlib's object API with the Agg canvas (no pyplot, no global backend change), so it is safe to call
from a notebook or a headless job.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from nemo_is_plugin.diagnose.analysis import Analysis
from nemo_is_plugin.diagnose.settings import IS_LEVELS

_LEVEL_COLORS = {"token": "tab:blue", "sequence": "tab:red", "sequence_mean": "tab:green", "cumulative": "tab:purple"}
_TRUNC_STYLES = {"none": "-", "tis": "--", "icepop": ":", "seq-mask-tis": "-.", "seq-mis": (0, (5, 1)),
                 "geo-rs": (0, (1, 1))}


def _figure(width: float, height: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def plot_weights_vs_length(a: Analysis, path: str | Path) -> Path:
    """One panel per IS level: each response's mean log w (before truncation) against its length.

    log w rather than w: sequence weights span hundreds of orders of magnitude on long responses; the log is
    finite, symmetric and shows the linear drift sum_t (p_t - g_t) directly. Dashed lines: log 2 and log 0.5.
    """
    levels = [lv for lv in IS_LEVELS if any(r.setting.level == lv for r in a.settings)]
    fig = _figure(3.6 * max(len(levels), 1), 3.4)
    axes = fig.subplots(1, max(len(levels), 1), squeeze=False)[0]
    lengths = a.valid_lengths
    ok = lengths > 0
    for ax, level in zip(axes, levels):
        r = next(r for r in a.settings if r.setting.level == level)  # log w does not depend on truncation
        y = r.response_log_w[ok]
        ax.scatter(lengths[ok], y, s=9, alpha=0.6, color=_LEVEL_COLORS[level], edgecolors="none")
        _binned_median(ax, a, r.response_log_w, color="black")
        for ref in (math.log(2.0), math.log(0.5)):
            ax.axhline(ref, color="gray", linestyle="--", linewidth=0.8)
        ax.axhline(0.0, color="gray", linewidth=0.6)
        ax.set_xscale("log")
        ax.set_title(f"{level}")
        ax.set_xlabel("response length (valid tokens)")
        ax.set_ylabel("mean log w per response")
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
        ax.plot(xs, ys, color=color, marker="o", linewidth=1.2, label="bin median")


def plot_bins(a: Analysis, path: str | Path) -> Path:
    """Three panels over the length bins: ESS, mean weight (log scale), fraction of tokens masked; a line per setting."""
    fig = _figure(13.0, 4.2)
    ax_ess, ax_mean, ax_mask = fig.subplots(1, 3)
    x = np.arange(len(a.bins))
    for r in a.settings:
        style = dict(color=_LEVEL_COLORS.get(r.setting.level, "black"),
                     linestyle=_TRUNC_STYLES.get(r.setting.truncation, "-"), marker="o", markersize=3, linewidth=1.2)
        ess = [st.ess for st in r.by_bin]
        mean = [st.mean if st.mean > 0 else np.nan for st in r.by_bin]
        masked = [st.masked for st in r.by_bin]
        ax_ess.plot(x, ess, label=r.setting.name, **style)
        ax_mean.plot(x, mean, **style)
        ax_mask.plot(x, masked, **style)
    labels = [b.label for b in a.bins]
    for ax, title in ((ax_ess, "effective sample size (1 = uniform)"), (ax_mean, "mean weight"),
                      (ax_mask, "fraction of tokens masked")):
        ax.set_xticks(x, labels, rotation=30)
        ax.set_xlabel("response length (valid tokens)")
        ax.set_title(title)
    ax_ess.set_ylim(-0.02, 1.02)
    ax_mask.set_ylim(-0.02, 1.02)
    ax_mean.set_yscale("log")
    ax_mean.axhline(1.0, color="gray", linewidth=0.6)
    fig.legend(*ax_ess.get_legend_handles_labels(), loc="outside right center", fontsize=7)
    fig.suptitle("IS weights by response length (color: level; line style: truncation)")
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
