"""The figure of the drift experiment (:mod:`.drift`), drawn from its result dict (no computation here)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from nemo_is_plugin.apps.evidence.plots import plt, save_figure

COLORS = {"plain": "C0", "token_tis": "C3"}


def _gap_panel(ax, result: dict, precision: str) -> None:
    steps = np.arange(result["steps"])
    for c in result["conditions"]:
        if c["precision"] != precision:
            continue
        style = "-" if c["score_centering"] else ":"
        label = f"{c['base']}, SC {'on' if c['score_centering'] else 'off'}"
        ax.plot(steps, c["gap_mean"], style, color=COLORS[c["base"]], lw=1.2, label=label)
    ax.set_yscale("log")
    ax.set_xlabel("GRPO step (fresh rollout each)")
    ax.set_ylabel("mean |log p_train - log q| per token")
    ax.set_title(f"{precision} engine: trainer-sampler gap (mean of {len(result['seeds'])} seeds)", fontsize=9)
    ax.legend(fontsize=7)


def _diff_panel(ax, result: dict) -> None:
    """Paired per-seed difference SC on minus off, averaged over seeds, with +-1 standard error."""
    steps = np.arange(result["steps"])
    by_key = {(c["base"], c["precision"], c["score_centering"]): c for c in result["conditions"]}
    styles = {"fp8": ":", "int4": "-"}
    for (base, precision, sc), on in by_key.items():
        if not sc:
            continue
        off = by_key[(base, precision, False)]
        diff = np.array([r["gap"] for r in on["runs"]]) - np.array([r["gap"] for r in off["runs"]])
        mean = diff.mean(0)
        se = diff.std(0, ddof=1) / np.sqrt(len(diff)) if len(diff) > 1 else np.zeros_like(mean)
        color = COLORS[base]
        ax.plot(steps, mean, styles[precision], color=color, lw=1.2, label=f"{base}, {precision}")
        ax.fill_between(steps, mean - se, mean + se, color=color, alpha=0.15, lw=0)
    ax.axhline(0.0, color="grey", lw=0.8)
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("gap with SC - gap without (paired seeds)")
    ax.set_title("the term's effect on the gap (band: +-1 s.e. over seeds)", fontsize=9)
    ax.legend(fontsize=7)


def plot_drift(result: dict, path: Path) -> Path:
    precisions = sorted({c["precision"] for c in result["conditions"]}, key=["fp8", "int4"].index)
    fig, axes = plt.subplots(1, len(precisions) + 1, figsize=(5.5 * (len(precisions) + 1), 4), layout="constrained")
    for ax, precision in zip(axes, precisions):
        _gap_panel(ax, result, precision)
    _diff_panel(axes[-1], result)
    fig.suptitle(
        f"Drift with and without score centering (top-{result['top_k']} head; B = {result['batch']}, "
        f"L = {result['length']}, V = {result['vocab']})",
        fontsize=10,
    )
    return save_figure(fig, path)
