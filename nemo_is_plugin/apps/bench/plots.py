"""The two benchmark figures (matplotlib, Agg backend): time ratios per model and path, and peak memory vs tokens."""

from __future__ import annotations

from pathlib import Path

from nemo_is_plugin.apps.bench.report import (
    MIB,
    TARGET_FWD,
    TARGET_FWDBWD,
    TARGET_SINGLE_PASS,
    TARGET_TWO_PASS,
    derived_rows,
    is_gpu_run,
    memory_fit,
)

PATH_COLORS = {
    "naive": "#c0504d",
    "from_logits": "#f79646",
    "fused_linear": "#4f81bd",
    "fused_2pass": "#8064a2",
    "fused_triton": "#1f3f7a",
    "fused_2pass_triton": "#4b2f6e",
    "liger": "#9bbb59",
    "cce": "#4bacc6",
    "matmul": "#7f7f7f",
}


def plot_ratios(results: dict, path: Path) -> Path:
    """Grouped bars: forward and forward+backward time / bare forward GEMM, per model, one bar per path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in derived_rows(results) if r["path"] != "loss"]
    models = list(dict.fromkeys(r["model"] for r in rows))
    paths = list(dict.fromkeys(r["path"] for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    width = 0.8 / len(paths)
    # the targets that apply: CPU ones on a CPU run; on a GPU run single pass 3.5x, two pass 4.5x (no forward target)
    lines = (
        {"fwd": (), "fwdbwd": (TARGET_SINGLE_PASS, TARGET_TWO_PASS)}
        if is_gpu_run(results)
        else {"fwd": (TARGET_FWD,), "fwdbwd": (TARGET_FWDBWD,)}
    )
    for ax, kind, title in ((axes[0], "fwd", "forward (no grad)"), (axes[1], "fwdbwd", "forward + PG loss + backward")):
        for j, p in enumerate(paths):
            vals = [
                next((r[f"{kind}_ratio"] for r in rows if r["model"] == m and r["path"] == p), None) or 0.0
                for m in models
            ]
            xs = [i + (j - (len(paths) - 1) / 2) * width for i in range(len(models))]
            ax.bar(xs, vals, width, label=p, color=PATH_COLORS.get(p))
        for style, target in zip(("--", ":"), lines[kind]):
            ax.axhline(target, color="k", ls=style, lw=1, label=f"target {target}x")
        ax.set_xticks(range(len(models)), models, rotation=15)
        ax.set_ylabel("time / bare LM-head GEMM")
        ax.set_title(f"{title}; targets {', '.join(f'{t}x' for t in lines[kind]) or 'none'}")
    handles, labels = axes[1].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=8, frameon=False)
    cfg, machine = results["config"], results["machine"]
    where = f"{cfg.get('device', 'cpu').upper()} {cfg.get('dtype', 'float32')}"
    name = machine.get("device_name", machine["cpu"])
    fig.suptitle(f"{where}, {cfg['tokens']} tokens per shape ({name})", fontsize=9)
    fig.tight_layout(rect=(0, 0.07, 1, 1))  # room for the shared legend below the axes
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_memory(results: dict, path: Path) -> Path:
    """Peak forward+backward memory above the inputs vs tokens (log-log), with the linear fit's extrapolation and the
    direct measurements at the target token count."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sweep, fits = results["memory_sweep"], memory_fit(results)
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for p in dict.fromkeys(s["path"] for s in sweep):
        pts = sorted((s["tokens"], s["peak_bytes"] / MIB) for s in sweep if s["path"] == p)
        ax.plot(*zip(*pts), "o-", label=p, color=PATH_COLORS.get(p))
        if p in fits:
            f = fits[p]
            ax.plot(
                [f["tokens"], f["target_tokens"]],
                [f["measured"] / MIB, f["extrapolated"] / MIB],
                ":",
                color=PATH_COLORS.get(p),
            )
    for d in results.get("memory_direct", []):
        ax.plot(
            [d["tokens"]],
            [d["peak_bytes"] / MIB],
            "*",
            ms=12,
            color=PATH_COLORS.get(d["path"]),
            label=f"{d['path']} measured at {d['tokens']}",
        )
    h, v = results["config"]["memory_shape"]
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("tokens")
    ax.set_ylabel("peak MiB above inputs (fwd + loss + bwd)")
    ax.set_title(f"H={h}, V={v}; dotted: linear extrapolation; stars: measured", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


__all__ = ["plot_memory", "plot_ratios"]
