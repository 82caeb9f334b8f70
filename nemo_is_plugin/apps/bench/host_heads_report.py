"""Reports of ``nemo-is bench --host-heads`` (:mod:`.host_heads_run`): the table, the targets, the docs section.

The targets, evaluated on a real GPU run at their setting (bf16, 16,384 tokens; ``comparability_note`` says when a
run is not one), per model shape:

- each plugin head (``plugin``, ``plugin_nemo_rl``, ``plugin_verl``): forward+backward <= 4.5x the forward GEMM;
- NeMo-RL's fused head >= 5x slower than the plugin's drop-in for it (``nemo_rl`` / ``plugin_nemo_rl``);
- verl's fused kernel slower than the plugin's drop-in for it (``verl`` / ``plugin_verl`` > 1);
- each plugin head's peak memory <= dW + dX + 1 GiB (the gradients it must return, plus 1 GiB of working memory).

The GPU section of ``docs/performance.md`` is the project's tooling: ``tools/bench_docs/host_heads_section.py``.
"""

from __future__ import annotations

from nemo_is_plugin.apps.bench.report import (
    GIB,
    QUICK_NOTE,
    format_value,
    gpu_memory_bound,
    is_gpu_run,
    is_gpu_target_run,
)

SECTION = "host-heads"
PLUGIN_HEADS = ("plugin", "plugin_nemo_rl", "plugin_verl")
RIVAL = {"nemo_rl": "plugin_nemo_rl", "verl": "plugin_verl"}
MAX_RATIO, NEMO_RL_SPEEDUP = 4.5, 5.0
COLUMNS = (  # header, key, kind
    ("model", "model", "str"),
    ("head", "head", "str"),
    ("backend", "backend", "str"),
    ("f+b x GEMM", "ratio", "ratio"),
    ("f+b ms", "fwdbwd_s", "ms"),
    ("host / plugin time", "vs_plugin", "ratio"),
    ("peak GiB", "peak_bytes", "gib"),
    ("log-prob err", "lp_err", "err"),
    ("entropy err", "ent_err", "err"),
    ("dX err", "dx_err", "err"),
    ("dW err", "dw_err", "err"),
)


def _by_head(results: dict) -> dict[tuple[str, str], dict]:
    return {(r["model"], r["head"]): r for r in results["rows"]}


def rows_with_comparisons(results: dict) -> list[dict]:
    """The rows, a host's with its time over the plugin drop-in's (``vs_plugin``)."""
    table, out = _by_head(results), []
    for r in results["rows"]:
        rival = table.get((r["model"], RIVAL.get(r["head"], "")))
        mine, theirs = r.get("fwdbwd_s"), None if rival is None else rival.get("fwdbwd_s")
        out.append(dict(r, vs_plugin=None if mine is None or not theirs else mine / theirs))
    return out


def table_cells(results: dict) -> tuple[list[str], list[list[str]]]:
    cells = []
    for r in rows_with_comparisons(results):
        failed = r.get("failed") or {}
        cells.append(
            [
                "failed" if failed and r.get(k) is None and kind != "str" else format_value(r.get(k), kind)
                for _, k, kind in COLUMNS
            ]
        )
    return [h for h, _, _ in COLUMNS], cells


def comparability_note(results: dict) -> str | None:
    """Why this run's numbers cannot be held against the targets (None: they can)."""
    cfg = results["config"]
    if cfg.get("quick"):
        return QUICK_NOTE
    if not is_gpu_run(results):
        return "CPU run: the targets are GPU ones (H100 / H200, bfloat16, 16,384 tokens); CPU ratios do not carry over."
    if not is_gpu_target_run(results):
        return f"GPU run at {cfg['tokens']:,} {cfg['dtype']} tokens: the targets are defined at 16,384 bfloat16 tokens."
    return None


def targets(results: dict) -> list[dict]:
    """Each target of the module docstring on every shape: ``{target, value, ok}`` (a row not measured: no entry)."""
    if comparability_note(results) is not None:
        return []
    dtype, table, out = results["config"]["dtype"], _by_head(results), []
    for model in dict.fromkeys(r["model"] for r in results["rows"]):
        for head in PLUGIN_HEADS:
            row = table.get((model, head))
            if row and row.get("ratio") is not None:
                out.append(
                    dict(
                        target=f"{model}: {head} f+b <= {MAX_RATIO}x GEMM",
                        value=row["ratio"],
                        ok=row["ratio"] <= MAX_RATIO,
                    )
                )
            if row and row.get("peak_bytes") is not None:
                bound = gpu_memory_bound(row, dtype)
                out.append(
                    dict(
                        target=f"{model}: {head} peak <= dW + dX + 1 GiB = {bound / GIB:.3g} GiB (GiB)",
                        value=row["peak_bytes"] / GIB,
                        ok=row["peak_bytes"] <= bound,
                    )
                )
        for host, floor in (("nemo_rl", NEMO_RL_SPEEDUP), ("verl", 1.0)):
            host_row, mine = table.get((model, host)), table.get((model, RIVAL[host]))
            if host_row and mine and host_row.get("fwdbwd_s") and mine.get("fwdbwd_s"):
                speedup = host_row["fwdbwd_s"] / mine["fwdbwd_s"]
                word = f">= {floor:g}x" if host == "nemo_rl" else "> 1x"
                out.append(
                    dict(
                        target=f"{model}: {RIVAL[host]} {word} faster than {host}",
                        value=speedup,
                        ok=speedup >= floor if host == "nemo_rl" else speedup > 1.0,
                    )
                )
    return out


def rich_table(results: dict):
    from rich.table import Table

    headers, cells = table_cells(results)
    table = Table(title="The hosts' fused LM heads vs the plugin's (ratios to the forward GEMM of the same run)")
    for i, h in enumerate(headers):
        table.add_column(h, justify="left" if i < 3 else "right")
    for row in cells:
        table.add_row(*row)
    return table


def failure_lines(results: dict) -> list[str]:
    lines = [
        f"{r['model']} {r['head']} {what}: {err}"
        for r in results["rows"]
        for what, err in (r.get("failed") or {}).items()
    ]
    return lines + [f"{name} not measured: {why}" for name, why in results.get("skipped", {}).items()]


__all__ = [
    "comparability_note",
    "failure_lines",
    "rich_table",
    "rows_with_comparisons",
    "table_cells",
    "targets",
]
