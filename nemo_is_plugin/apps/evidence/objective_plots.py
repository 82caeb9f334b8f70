"""The figure of the policy-objective experiment (:mod:`.objectives`, :mod:`.objective_shapes`): one panel per
objective's measured property, drawn from the result dict (no computation here)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from nemo_is_plugin.apps.evidence.plots import plt, save_synthetic_batch_figure

MASKING = ("ppo_clip", "dppo_tv", "dppo_kl", "prob_diff")


def _masking_title(name: str, config: dict) -> str:
    """Panel title with the thresholds the experiment ran with (read from its result, not repeated here)."""
    if name == "ppo_clip":
        return f"PPO clip ({config['ratio_clip_min']:g} / {config['ratio_clip_max']:g}): clip fraction"
    if name == "prob_diff":
        return f"prob_diff (|p - q| <= {config['prob_diff_threshold']:g}): masked fraction"
    kind = "TV" if name == "dppo_tv" else "KL"
    return f"DPPO Binary-{kind} ({config['dppo_delta_low']:g} / {config['dppo_delta_high']:g}): masked fraction"


def _drift_axis(ax, sweep: dict) -> np.ndarray:
    """Log-x drift axis over the swept drifts > 0; returns the index of those drifts."""
    drifts = np.array(sweep["drifts"])
    keep = np.nonzero(drifts > 0)[0]
    ax.set_xscale("log")
    ax.set_xlabel("logit drift s (pi = softmax(theta_old + s eps))")
    return keep


def _masking_panel(ax, sweep: dict, name: str) -> None:
    keep = _drift_axis(ax, sweep)
    s = np.array(sweep["drifts"])[keep]
    row = sweep["objectives"][name]
    ax.plot(s, np.array(row["clip_fraction"])[keep], "C0-o", ms=3, label="tokens dropped / clipped")
    ax.plot(s, np.array(row["deviation"])[keep], "C3-s", ms=3, label="||g - g_pg|| / ||g_pg||")
    if name != "ppo_clip":
        ppo = np.array(sweep["objectives"]["ppo_clip"]["clip_fraction"])[keep]
        ax.plot(s, ppo, "--", color="grey", label="PPO clip fraction, same batches")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(_masking_title(name, sweep["configs"][name]), fontsize=9)


def _cppo_length_panel(ax, cppo: dict) -> None:
    lengths = np.array(cppo["lengths"])
    for i, (drift, rows) in enumerate(cppo["by_length"].items()):
        ax.plot(lengths, rows["cppo_budget_exhausted_position_fraction"], "-o", ms=3, color=f"C{i}", label=f"s={drift}")
        ax.plot(lengths, rows["cppo_budget_exhausted_seq_fraction"], ":", color=f"C{i}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("response length L (tokens)")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title("CPPO: budget runs out at (fraction of L; dotted: seqs exhausted)", fontsize=9)


def _cppo_limit_panel(ax, cppo: dict) -> None:
    lim = cppo["limit"]
    ax.plot(lim["delta_b"], lim["budget_bound_fraction"], "C0-o", ms=3, label="loss metric cppo_budget_bound_fraction")
    ax.plot(lim["delta_b"], lim["mask_disagreement"], "C3x", ms=7, label="mask != per-token mask (delta_b = inf)")
    ax.axvline(1.0, color="grey", lw=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("budget floor delta_b")
    ax.set_title(f"CPPO limit: budget-only drops, L={lim['length']}, s={lim['drift']:g}", fontsize=9)


def _sapo_panel(ax, sapo: dict) -> None:
    r = np.array(sapo["ratios"])
    w = sapo["weights"]
    tau_pos, tau_neg = sapo["configs"]["sapo"]["sapo_tau_pos"], sapo["configs"]["sapo"]["sapo_tau_neg"]
    ax.plot(r, w["unclipped"]["pos"], color="grey", lw=1, label="unclipped: w = r")
    ax.plot(r, w["ppo_clip"]["pos"], "C1--", label="PPO clip, A > 0")
    ax.plot(r, w["ppo_clip"]["neg"], "C2--", label="PPO clip, A < 0")
    ax.plot(r, w["sapo"]["pos"], "C1-", lw=2, label=f"SAPO gate, A > 0 (tau {tau_pos:g})")
    ax.plot(r, w["sapo"]["neg"], "C2-", lw=2, label=f"SAPO gate, A < 0 (tau {tau_neg:g})")
    ax.plot([1.0], [1.0], "k*", ms=10)
    ax.set_xlabel("ratio r = pi / pi_old")
    ax.set_ylabel("gradient weight w: dL/dc = -A w / N")
    ax.set_title("SAPO: soft gate vs PPO's hard clip", fontsize=9)


def _gmpo_panel(ax, gmpo: dict) -> None:
    lengths = np.array(gmpo["lengths"])
    labels = {
        "token": "token ratio r_t",
        "gspo": "GSPO exp(mean d)",
        "gmpo": f"GMPO exp(mean clip d), eps {gmpo['clip']:g}",
    }
    for i, (key, label) in enumerate(labels.items()):
        ax.plot(lengths, gmpo["ratios"][key]["std"], "-o", ms=3, color=f"C{i}", label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("response length L (tokens)")
    ax.set_ylabel("std of the ratio within an advantage sign")
    ax.set_title(f"GMPO: ratio spread vs length, s={gmpo['drift']:g}", fontsize=9)


def _gpg_panel(ax, sweep: dict) -> None:
    keep = _drift_axis(ax, sweep)
    s = np.array(sweep["drifts"])[keep]
    ax.plot(s, np.array(sweep["untruncated_grad_norm"])[keep], color="grey", label="untruncated PG (-A r)")
    ax.plot(s, np.array(sweep["objectives"]["ppo_clip"]["grad_norm"])[keep], "C1--", label="PPO clip")
    ax.plot(s, np.array(sweep["objectives"]["gpg"]["grad_norm"])[keep], "C0-o", ms=3, label="GPG (-A log pi)")
    ax.set_ylabel("||g|| (batch gradient wrt logits)")
    ax.set_title("GPG: gradient norm vs drift", fontsize=9)


def _dro_panel(ax, sweep: dict) -> None:
    keep = _drift_axis(ax, sweep)
    s = np.array(sweep["drifts"])[keep]
    for i, name in enumerate(n for n in sweep["objectives"] if n.startswith("dro")):
        ax.plot(s, np.array(sweep["objectives"][name]["pull_back"])[keep], "-o", ms=3, color=f"C{3 + i}", label=name)
    for name, style in (("gpg", "C0-"), ("ppo_clip", "C1--")):
        ax.plot(s, np.array(sweep["objectives"][name]["pull_back"])[keep], style, label=name)
    ax.axhline(0, color="grey", lw=0.6)
    ax.set_ylabel("<g, grad P> / ||grad P||,  P = mean (log r)^2 / 2")
    ax.set_title("DRO: pull back toward pi_old per unit step", fontsize=9)


def plot_objectives(result: dict, path: Path) -> Path:
    """2 x 5 panels: the drift sweep of PPO clip / DPPO-TV / DPPO-KL / prob_diff, CPPO's budget (length, limit),
    SAPO's gate, GMPO's spread, GPG's gradient norm, DRO's pull-back."""
    sweep = result["drift_sweep"]
    fig, axes = plt.subplots(2, 5, figsize=(25, 9))
    fig.subplots_adjust(wspace=0.3, hspace=0.35)
    for ax, name in zip(axes[0, :4], MASKING):
        _masking_panel(ax, sweep, name)
    _cppo_length_panel(axes[0, 4], result["cppo_budget"])
    _cppo_limit_panel(axes[1, 0], result["cppo_budget"])
    _sapo_panel(axes[1, 1], result["sapo_gate"])
    _gmpo_panel(axes[1, 2], result["gmpo_spread"])
    _gpg_panel(axes[1, 3], sweep)
    _dro_panel(axes[1, 4], sweep)
    draws = "tokens from the rollout policy, pi drifted by s from pi_old"
    return save_synthetic_batch_figure(fig, axes.flat, sweep, "Policy objectives", draws, path)
