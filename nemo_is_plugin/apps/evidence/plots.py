"""Figures of the evidence experiments, drawn from their JSON-ready result dicts (no computation here).

Each ``plot_*`` function takes the dict returned by the matching ``run_*`` and a path, and writes one PNG.
Matplotlib runs on the non-interactive Agg backend so the command works on headless machines.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)
import numpy as np  # noqa: E402

from nemo_is_plugin.apps.evidence.stats import Z95  # noqa: E402

LEVEL_FORMULA = {
    "token": "token: exp(p_t - g_t)",
    "sequence": "sequence: exp(sum_t (p_t - g_t))",
    "sequence_mean": "sequence_mean: exp(mean_t (p_t - g_t))",
    "cumulative": "cumulative: exp(sum_{j<=t} (p_j - g_j))",
}
LEVEL_STYLE = {"token": "-.", "sequence": "-", "sequence_mean": "--", "cumulative": ":"}
# Weights below this are drawn at the axis floor: a 2% shift takes exp(sum) to ~1e-78 at 9k tokens.
WEIGHT_FLOOR = 1e-4


def save_figure(fig, path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight", metadata={"Software": None})
    plt.close(fig)
    return path


def save_synthetic_batch_figure(fig, axes, sweep: dict, what: str, draws: str, path: Path) -> Path:
    """Save a figure of the synthetic-batch experiments: a legend in each panel and a title saying ``what`` it shows on
    which batches (``sweep``'s sequences x tokens and actions) and how their tokens were drawn (``draws``)."""
    for ax in axes:
        ax.legend(fontsize=7)
    fig.suptitle(
        f"{what} on synthetic batches ({sweep['num_seqs']} x {sweep['length']} tokens, "
        f"{sweep['num_actions']} actions; {draws})",
        fontsize=11,
    )
    return save_figure(fig, path)


def _length_axis(ax, lengths) -> None:
    ax.set_xscale("log", base=2)
    ax.set_xlabel("response length L (tokens)")
    ax.set_xticks([64, 256, 1024, 4096, 16384], ["64", "256", "1k", "4k", "16k"])


def plot_is_collapse(result: dict, path: Path, dist_name: str = "seed fit") -> Path:
    """2x2 panels, one per IS level: mean, median, std and 5-95% band of the weight vs length, for one distribution.

    The seed's reported state (mean 0.4, std 0.27 at 9k tokens) is marked on the sequence panel.
    """
    lengths = np.array(result["lengths"])
    stats = result["stats"][dist_name]
    desc = next(d["description"] for d in result["distributions"] if d["name"] == dist_name)
    fig, axes = plt.subplots(2, 2, figsize=(11, 8), sharex=True)
    for ax, level in zip(axes.flat, result["levels"]):
        s = {k: np.maximum(np.array(v), WEIGHT_FLOOR) for k, v in stats[level].items()}
        ax.fill_between(lengths, s["p5"], s["p95"], alpha=0.2, color="C0", label="5th-95th percentile")
        ax.plot(lengths, s["mean"], "C0-o", ms=3, label="mean = effective LR scale")
        ax.plot(lengths, s["p50"], "C0:", label="median")
        ax.plot(lengths, s["std"], "C3--", label="std")
        if level == "sequence":
            c = result["seed_check"]
            ax.plot([c["length"]], [c["seed_mean"]], "k*", ms=14, label="seed 002: mean 0.4 at ~9k")
            ax.plot([c["length"]], [c["seed_std"]], "kX", ms=10, label="seed 002: std 0.27 at ~9k")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_yscale("log")
        ax.set_ylim(WEIGHT_FLOOR, 20)
        ax.set_title(LEVEL_FORMULA[level], fontsize=10)
        _length_axis(ax, lengths)
        ax.set_ylabel("IS weight (token-pooled)")
    axes[0, 1].legend(fontsize=8, loc="lower left")
    fig.suptitle(f"IS-weight collapse with length, mismatch {desc}", fontsize=11)
    return save_figure(fig, path)


def plot_is_lr_scale(result: dict, path: Path) -> Path:
    """One column per mismatch distribution. Top: mean weight (effective LR scale) of every level vs length;
    bottom: effective-sample-size fraction, the share of the batch that actually carries that learning rate."""
    lengths = np.array(result["lengths"])
    dists = result["distributions"]
    fig, axes = plt.subplots(2, len(dists), figsize=(4.2 * len(dists), 7), sharex=True, sharey="row", squeeze=False)
    for col, dist in enumerate(dists):
        stats = result["stats"][dist["name"]]
        top, bottom = axes[0, col], axes[1, col]
        for i, level in enumerate(result["levels"]):
            top.plot(
                lengths, np.maximum(stats[level]["mean"], WEIGHT_FLOOR), LEVEL_STYLE[level], color=f"C{i}", label=level
            )
            bottom.plot(lengths, stats[level]["ess_fraction"], LEVEL_STYLE[level], color=f"C{i}", label=level)
        tis = np.maximum(stats["sequence"]["tis_mean"], WEIGHT_FLOOR)
        top.plot(lengths, tis, "-", color="C1", lw=3, alpha=0.35, label=f"sequence, TIS at {result['tis_high']:g}")
        top.set_yscale("log")
        top.set_ylim(WEIGHT_FLOOR, 5)
        top.axhline(1.0, color="grey", lw=0.8)
        top.set_title(f"{dist['name']}: shift {dist['shift']:+.2g}, spread {dist['spread']:.2g}", fontsize=9)
        bottom.set_ylim(0, 1.05)
        _length_axis(bottom, lengths)
    axes[0, 0].set_ylabel("effective LR scale = mean IS weight")
    axes[1, 0].set_ylabel("ESS fraction (sum w)^2 / (n sum w^2)")
    axes[0, 0].legend(fontsize=8, loc="lower left")
    fig.suptitle(
        "Effective learning-rate scale of each IS level (i.i.d. per-token Student-t mismatch, df=4)", fontsize=11
    )
    return save_figure(fig, path)


def plot_ctpo_variance(result: dict, path: Path) -> Path:
    """(a) full/cumulative variance ratio vs t against (1+d)^(H-t); (b) unbiasedness; (c) z-scores of the means."""
    runs = result["runs"]
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.5))
    fig.subplots_adjust(wspace=0.3)
    ax = axes[0]
    for i, run in enumerate(runs):
        t = np.array(run["t"])
        pred = np.array(run["predicted_second_moment_ratio"])
        # error bars: the relative delta-method error of the second-moment ratio, applied to the variance ratio
        rel_se = np.array(run["measured_second_moment_ratio_se"]) / np.array(run["measured_second_moment_ratio"])
        meas = np.array(run["measured_variance_ratio"])
        ax.errorbar(
            t,
            meas,
            yerr=Z95 * rel_se * meas,
            fmt="o",
            ms=3,
            color=f"C{i}",
            capsize=2,
            label=f"measured Var(full)/Var(cum), d={run['chi2']:g}",
        )
        ax.plot(t, pred, "-", color=f"C{i}", label=f"(1+d)^(H-t), d={run['chi2']:g}")
        ax.plot(
            t,
            run["predicted_variance_ratio"],
            ":",
            color=f"C{i}",
            lw=1,
            label="exact variance ratio (incl. squared mean)" if i == len(runs) - 1 else None,
        )
    ax.set_yscale("log")
    ax.set_xlabel("token position t")
    ax.set_ylabel("Var(full-sequence) / Var(cumulative)")
    ax.set_title(
        f"Full-sequence vs cumulative ratio, H={runs[0]['horizon']}, N={runs[0]['num_samples']:,}", fontsize=10
    )
    ax.legend(fontsize=8)

    run = runs[-1]
    t = np.array(run["t"])
    ax = axes[1]
    for key, color, label in (("full", "C3", "full-sequence ratio"), ("cumulative", "C0", "cumulative ratio")):
        mean, ci = np.array(run[f"projection_{key}"]), np.array(run[f"projection_{key}_ci"])
        ax.fill_between(t, mean - ci, mean + ci, color=color, alpha=0.2)
        ax.plot(t, mean, "o-", ms=3, color=color, label=f"{label}: MC mean, 95% CI")
    ax.axhline(run["projection_exact"], color="k", lw=1.5, label="exact gradient")
    ax.set_xlabel("token position t")
    ax.set_ylabel("mean gradient along the exact gradient")
    ax.set_title(f"Both unbiased; the cumulative one is tighter (d={run['chi2']:g})", fontsize=10)
    ax.legend(fontsize=8)

    ax = axes[2]
    for key, color, marker in (("cumulative", "C0", "o"), ("full", "C3", "x")):
        z = np.array(run[f"z_{key}"])
        ax.plot(
            np.repeat(t, z.shape[1]),
            z.ravel(),
            marker,
            ms=3,
            color=color,
            ls="none",
            alpha=0.6,
            label=f"{key}: max |z| = {np.abs(z).max():.2f}",
        )
    for y in (-Z95, Z95):
        ax.axhline(y, color="grey", ls="--", lw=0.8)
    ax.set_xlabel("token position t")
    ax.set_ylabel("(MC mean - exact) / standard error, every component")
    ax.set_title("z-scores of the estimators' means", fontsize=10)
    ax.legend(fontsize=8)
    return save_figure(fig, path)


def plot_kl_gradient_bias(result: dict, path: Path) -> Path:
    """Per-component MC mean gradient with 95% CIs for each KL variant, against the exact gradient of KL."""
    exact = np.array(result["exact_gradient"])
    k = len(exact)
    plain = [v for v in result["variants"] if not v["loss_config"]]
    groups = (
        ("kl_penalty, pathwise gradient (verl; seed 003)", [v for v in plain if not v["score_weight"]]),
        ("kl_penalty with NeMo-RL's score weight exp(c - sg c)", [v for v in plain if v["score_weight"]]),
        ("ClippedPGLoss's KL term (beta = 1, A = 0)", [v for v in result["variants"] if v["loss_config"]]),
    )
    fig, axes = plt.subplots(1, len(groups), figsize=(7 * len(groups), 4.5), sharey=True)
    for ax, (title, variants) in zip(axes, groups):
        width = 0.8 / len(variants)
        for i, v in enumerate(variants):
            x = np.arange(k) + (i - (len(variants) - 1) / 2) * width
            mean, se = np.array(v["mean"]), np.array(v["se"])
            name = v["name"].replace(" + score weight", "")
            p = f"= {v['p_value']:.2g}" if v["p_value"] > 1e-300 else "< 1e-300"
            # one colour per estimator across panels: k1, k2, k3, straight-through (value k3, gradient k2)
            color = "C3" if v["straight_through"] else f"C{int(v['kl_type'][1]) - 1}"
            ax.errorbar(
                x,
                mean,
                yerr=Z95 * se,
                fmt="o",
                ms=4,
                capsize=2,
                color=color,
                label=f"{name}: max |z| = {v['max_abs_z']:.1f}, p {p}",
            )
        ax.hlines(exact, np.arange(k) - 0.45, np.arange(k) + 0.45, colors="k", lw=2, label="exact grad KL")
        ax.axhline(0, color="grey", lw=0.6)
        ax.set_xticks(np.arange(k), [f"theta_{i}" for i in range(k)])
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=8)
    axes[0].set_ylabel(f"E[grad] (MC, N={result['num_samples']:,}, 95% CI)")
    fig.suptitle(
        f"KL(pi_theta || pi_ref) = {result['exact_kl']:.3f}, K={k}: Monte Carlo mean gradient of each estimator "
        "(p: Hotelling test of E[grad] = grad KL)",
        fontsize=10,
    )
    return save_figure(fig, path)
