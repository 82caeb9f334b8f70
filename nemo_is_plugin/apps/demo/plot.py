"""``comparison.png``: the loss settings side by side, from ``metrics.jsonl`` and ``summary.json`` of a run directory.

Top row, short responses, per GRPO step: reward, the setting's own IS weight (mean +- std), mismatch KL.
Bottom row: clip fraction and grad norm per step; and the long-response phase: each setting's IS weight at its own
level (mean with std bars, ESS printed), which is where exp(sum) collapses and sequence_mean stays near 1.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_rows(run_dir: str | Path) -> list[dict[str, Any]]:
    with open(Path(run_dir) / "metrics.jsonl") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def _series(rows: list[dict], config: str, phase: str, key: str) -> tuple[list[int], list[float]]:
    steps: list[int] = []
    values: list[float] = []
    for r in rows:
        value = r.get(key)
        if r["config"] == config and r["phase"] == phase and value is not None:
            steps.append(r["step"])
            values.append(value)
    return steps, values


def long_batches(run_dir: Path) -> list[tuple[Any, Any, Any]]:
    """The distinct long-phase batches of rollouts.jsonl as (prev, gen, mask) [B, R] tensors.

    Every setting's step 0 samples the same batch (same warm-start weights and seed), so it is kept once.
    """
    import torch

    groups: dict[tuple[str, int], list[dict]] = {}
    with open(run_dir / "rollouts.jsonl") as fh:
        for line in fh:
            rec = json.loads(line)
            if rec.get("phase") == "long":
                groups.setdefault((rec["config"], rec["step"]), []).append(rec)
    out, seen_first = [], False
    for (_, step), recs in groups.items():
        if step == 0:
            if seen_first:
                continue
            seen_first = True
        n = min(len(r["mask"]) for r in recs)
        prev, gen, mask = (
            torch.tensor([r[k][:n] for r in recs], dtype=torch.float64)
            for k in ("prev_logprobs", "generation_logprobs", "mask")
        )
        out.append((prev, gen, mask))
    return out


def _length_panel(ax_mean, ax_ess, run_dir: Path) -> None:
    """IS-weight mean and ESS vs response length, every level, from the long batches cut at length L (the first L
    tokens of an EOS-ignoring response are themselves a sample of an L-token response)."""
    from nemo_is_plugin.apps.demo.level_stats import level_stats

    batches = long_batches(run_dir) if (run_dir / "rollouts.jsonl").exists() else []
    if not batches:
        ax_mean.set_visible(False)
        ax_ess.set_visible(False)
        return
    longest = min(b[2].shape[1] for b in batches)
    lengths = [n for n in (8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192) if n <= longest]
    levels = (
        ("sequence", "exp(sum)"),
        ("sequence_mean", "sequence_mean"),
        ("token", "token"),
        ("cumulative", "cumulative"),
    )
    for level, label in levels:
        means, ess = [], []
        for n in lengths:
            stats = [level_stats(p[:, :n], g[:, :n], m[:, :n]) for p, g, m in batches]
            means.append(sum(s[f"is/{level}_mean"] for s in stats) / len(stats))
            ess.append(sum(s[f"is/{level}_ess"] for s in stats) / len(stats))
        ax_mean.plot(lengths, means, marker="o", ms=3, label=label)
        ax_ess.plot(lengths, ess, marker="o", ms=3, label=label)
    n_resp = sum(b[2].shape[0] for b in batches)
    for ax, what in ((ax_mean, "mean"), (ax_ess, "ESS (E w)^2 / E w^2")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("response length (tokens)")
        ax.axhline(1.0, color="k", lw=0.8)
        ax.grid(alpha=0.3)
        ax.set_title(f"IS weight {what} vs length\n({n_resp} long responses, every level)", fontsize=10)
    ax_mean.legend(fontsize=8)


def cfg_eval_prompts(summary: dict) -> Any:
    """How many prompts the final evaluation used (the stars of the reward panel)."""
    return (summary.get("config") or {}).get("eval", {}).get("prompts", "?")


def plot_comparison(run_dir: str | Path, out: str | Path | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    rows = read_rows(run_dir)
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    configs = list(dict.fromkeys(r["config"] for r in rows))
    colors = {c: plt.cm.tab10(i) for i, c in enumerate(configs)}
    fig, axes = plt.subplots(2, 4, figsize=(21, 8.5))

    def lines(ax, key, title, band=None, log=False):
        for c in configs:
            x, y = _series(rows, c, "short", key)
            ax.plot(x, y, marker="o", ms=3, color=colors[c], label=c)
            if band:
                _, s = _series(rows, c, "short", band)
                if len(s) == len(y):
                    ax.fill_between(
                        x, [a - b for a, b in zip(y, s)], [a + b for a, b in zip(y, s)], color=colors[c], alpha=0.12
                    )
        ax.set_title(title)
        ax.set_xlabel("GRPO step")
        if log:
            ax.set_yscale("symlog", linthresh=1e-4)
        ax.grid(alpha=0.3)

    ax = axes[0, 0]
    lines(ax, "reward", "train reward (short responses)")
    warm = summary.get("warm_start_reward")
    if warm is not None:
        ax.axhline(warm, color="k", ls="--", lw=1, label=f"warm start (eval) {warm:.2f}")
    finals = summary.get("final_reward") or {}
    for c, v in finals.items():
        n = len(_series(rows, c, "short", "reward")[0])
        ax.plot([n], [v], marker="*", ms=12, color=colors.get(c, "k"), ls="none")
    if finals:  # one grey legend entry explains the stars; each star has its setting's colour
        ax.plot(
            [],
            [],
            marker="*",
            ms=10,
            color="gray",
            ls="none",
            label=f"* final eval reward ({cfg_eval_prompts(summary)} prompts, colour: setting)",
        )
    ax.legend(fontsize=8)
    lines(axes[0, 1], "is_raw_weight_mean", "IS weight at the setting's level, mean +- std", band="is_raw_weight_std")
    axes[0, 1].axhline(1.0, color="k", lw=0.8)
    lines(axes[0, 2], "mismatch_kl_k3", "rollout/training mismatch KL (k3, per token)")
    lines(axes[1, 0], "clip_fraction", "clip fraction (policy ratio)")
    lines(axes[1, 1], "grad_norm", "grad norm (before clipping)")

    ax = axes[1, 2]
    long_rows = [r for r in rows if r["phase"] == "long"]
    if long_rows:
        length = max(r["response_length"] for r in long_rows)
        for j, c in enumerate(configs):
            own = [r for r in long_rows if r["config"] == c]
            if not own:
                continue
            m = sum(r["is_raw_weight_mean"] for r in own) / len(own)
            s = sum(r["is_raw_weight_std"] for r in own) / len(own)
            ess = sum(r["is_raw_weight_ess"] for r in own) / len(own)
            ax.bar(j, m, yerr=s, capsize=6, color=colors[c])
            ax.text(j, 0.02, f"mean {m:.2f}\nESS {ess:.2f}", ha="center", va="bottom", fontsize=8)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks(range(len(configs)), configs, fontsize=8)
        ax.set_title(
            f"{length:.0f}-token responses: IS weight at each\nsetting's level (mean +- std, before truncation)",
            fontsize=10,
        )
    else:
        ax.set_visible(False)
    _length_panel(axes[0, 3], axes[1, 3], run_dir)
    cfg = summary.get("config", {})
    fig.suptitle(
        "nemo-is demo: GRPO on a tiny Megatron MoE (TP={}), rollout engine {} {}".format(
            cfg.get("model", {}).get("tensor_parallel", "?"),
            cfg.get("rollout", {}).get("backend", "?"),
            cfg.get("rollout", {}).get("precision", "?"),
        ),
        fontsize=12,
    )
    fig.tight_layout()
    out = Path(out) if out else run_dir / "comparison.png"
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
