"""The figure of the rejection-rule experiment (:mod:`.rejection`), drawn from its result dict (no computation here)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from nemo_is_plugin.apps.evidence.plots import plt, save_synthetic_batch_figure

MIN_COUNT = 10  # a share of fewer rejected tokens is noise: not drawn
STYLES = {"k1": "C0-o", "k2": "C9:", "k3": "C2-s", "prob_diff": "C3-^"}


def _label(statistic: str, threshold: float) -> str:
    return f"{statistic}, |k1| <= {threshold:.3g}" if statistic == "k1" else f"{statistic} <= {threshold:.3g}"


def _mismatch_axis(ax, sweep: dict) -> tuple[np.ndarray, np.ndarray]:
    """Log-x mismatch axis over the swept scales > 0; returns (index, scales) of those scales."""
    m = np.array(sweep["mismatches"])
    keep = np.nonzero(m > 0)[0]
    ax.set_xscale("log")
    ax.set_xlabel("mismatch scale m")
    ax.axvline(sweep["reference_mismatch"], color="grey", lw=0.8, ls=":")
    ax.set_xlim(m[keep].min() / 1.25, m[keep].max() * 1.25)  # the same axis on both panels
    return keep, m[keep]


def _fraction_panel(ax, sweep: dict) -> None:
    keep, m = _mismatch_axis(ax, sweep)
    for s, row in sweep["statistics"].items():
        ms = 3 if s != "k2" else 0
        ax.plot(m, np.array(row["rejected_fraction"])[keep], STYLES[s], ms=ms, label=_label(s, sweep["thresholds"][s]))
    ax.axhline(sweep["target_fraction"], color="grey", lw=0.8)
    ax.set_ylabel("rejected fraction of tokens")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(
        f"token rules matched to reject {sweep['target_fraction']:g} at m = {sweep['reference_mismatch']:g}",
        fontsize=9,
    )


def _rare_panel(ax, sweep: dict) -> None:
    keep, m = _mismatch_axis(ax, sweep)
    for s, row in sweep["statistics"].items():
        share = np.array(row["low_prob_share"])[keep]
        counted = np.array(row["rejected_count"])[keep] >= MIN_COUNT
        ax.plot(m[counted], share[counted], STYLES[s], ms=3 if s != "k2" else 0, label=s)
    ax.axhline(sweep["low_prob_share_all_tokens"], color="grey", ls="--", label="share among all tokens")
    ax.set_ylabel(f"share of rejected tokens with mu < {sweep['low_prob']:g}")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(f"which tokens: rare ones (drawn where >= {MIN_COUNT} are rejected)", fontsize=9)


def _length_panel(ax, seq: dict) -> None:
    lengths = np.array(seq["lengths"])
    colors = {"k3": "C2", "prob_diff": "C3"}
    for name, fractions in seq["rejected_sequence_fraction"].items():
        agg, stat = name.split("_", 2)[1], name.split("_", 2)[2]
        style = "-o" if agg == "mean" else "--s"
        c = seq["thresholds"][name]
        ax.plot(lengths, fractions, style, ms=3, color=colors[stat], label=f"sequence_{agg}_{stat} <= {c:.3g}")
    ax.axhline(seq["target_fraction"], color="grey", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("response length L (tokens)")
    ax.set_ylabel("rejected fraction of sequences")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(
        f"sequence rules at m = {seq['mismatch']:g}, matched to reject {seq['target_fraction']:g} at "
        f"L = {seq['lengths'][0]}",
        fontsize=9,
    )


def plot_rejection(result: dict, path: Path) -> Path:
    """1 x 3 panels: rejected fraction vs mismatch, the rare share of the rejected tokens, sequence rules vs length."""
    sweep = result["mismatch_sweep"]
    fig, axes = plt.subplots(1, 3, figsize=(18, 5))
    fig.subplots_adjust(wspace=0.28, top=0.85)
    _fraction_panel(axes[0], sweep)
    _rare_panel(axes[1], sweep)
    _length_panel(axes[2], result["sequence_lengths"])
    draws = "tokens from mu, pi_prev moved by m times a Student-t logit direction"
    return save_synthetic_batch_figure(fig, axes, sweep, "IS rejection rules", draws, path)
