"""Derived numbers, targets, and the three renderings of a benchmark result: rich table, JSON, markdown + PNG plots.

Conventions (stated in the docs too): ratios divide by the bare forward GEMM ``hidden @ W.T`` of the same shape and
run (1 GEMM: the forward limit; the recomputing fused forward+backward does 4, the naive one 3); effective GFLOP/s
counts 2NHV for a forward and 8NHV for a forward+backward whatever a path really executes (Liger's convention);
memory is the peak of tracked tensor bytes above the inputs (MiB = 2^20 bytes).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

MIB = 2**20
TARGET_FWD, TARGET_FWDBWD, TARGET_MEMORY = 1.15, 4.4, 5.0


def derived_rows(results: dict) -> list[dict]:
    """The rows with ratios to the shape's matmul, tokens/s and effective GFLOP/s added."""
    matmul = {(r["model"], r["tokens"]): r["fwd_s"] for r in results["rows"] if r["path"] == "matmul"}
    out = []
    for r in results["rows"]:
        mm = matmul[(r["model"], r["tokens"])]
        flops = 2 * r["tokens"] * r["hidden"] * r["vocab"]
        d = dict(r)
        for kind, factor in (("fwd", 1), ("fwdbwd", 4)):
            t = r[f"{kind}_s"]
            d[f"{kind}_ratio"] = None if t is None else t / mm
            d[f"{kind}_tok_s"] = None if t is None else r["tokens"] / t
            d[f"{kind}_gflops"] = None if t is None or r["path"] == "loss" else factor * flops / t / 1e9
        out.append(d)
    return out


def memory_fit(results: dict) -> dict[str, dict]:
    """Per path: peak = a + b * tokens through the sweep's two largest token counts, evaluated at the target count."""
    target = results["config"]["extrapolate_tokens"]
    fits = {}
    for path in dict.fromkeys(p["path"] for p in results["memory_sweep"]):
        pts = sorted((p["tokens"], p["peak_bytes"]) for p in results["memory_sweep"] if p["path"] == path)
        if len(pts) < 2:
            continue
        (n1, m1), (n2, m2) = pts[-2], pts[-1]
        slope = (m2 - m1) / (n2 - n1)
        fits[path] = dict(bytes_per_token=slope, intercept=m2 - slope * n2, tokens=n2, measured=m2,
                          extrapolated=m2 + slope * (target - n2), target_tokens=target)
    return fits


def targets(results: dict) -> list[dict]:
    """The issue's CPU-checkable targets, each with the measured value and whether it holds."""
    rows, out = derived_rows(results), []
    fused = [r for r in rows if r["path"] == "fused_linear"]
    naive = {r["model"]: r for r in rows if r["path"] == "naive"}
    for r in fused:
        out.append(dict(target=f"{r['model']}: fused forward <= {TARGET_FWD}x matmul", value=r["fwd_ratio"],
                        ok=r["fwd_ratio"] <= TARGET_FWD))
        out.append(dict(target=f"{r['model']}: fused forward+backward <= {TARGET_FWDBWD}x matmul",
                        value=r["fwdbwd_ratio"], ok=r["fwdbwd_ratio"] <= TARGET_FWDBWD))
        if r["model"] in naive:
            nv = naive[r["model"]]
            out.append(dict(target=f"{r['model']}: fused forward faster than naive (time ratio fused/naive)",
                            value=r["fwd_s"] / nv["fwd_s"], ok=r["fwd_s"] < nv["fwd_s"]))
            out.append(dict(target=f"{r['model']}: fused forward+backward faster than naive (time ratio)",
                            value=r["fwdbwd_s"] / nv["fwdbwd_s"], ok=r["fwdbwd_s"] < nv["fwdbwd_s"]))
    for r in (r for r in rows if r["path"] == "fused_2pass"):
        out.append(dict(target=f"{r['model']}: two-pass fused forward+backward <= {TARGET_FWDBWD}x matmul "
                               "(sequence-level ratios)", value=r["fwdbwd_ratio"],
                        ok=r["fwdbwd_ratio"] <= TARGET_FWDBWD))
    direct = {p["path"]: p for p in results.get("memory_direct", [])}
    if "naive" in direct and "fused_linear" in direct:
        n, f = direct["naive"], direct["fused_linear"]
        ratio = n["peak_bytes"] / f["peak_bytes"]
        out.append(dict(target=f"peak memory naive/fused >= {TARGET_MEMORY}x at {n['tokens']} tokens (measured)",
                        value=ratio, ok=ratio >= TARGET_MEMORY))
    fits = memory_fit(results)
    if "naive" in fits and "fused_linear" in fits:
        n, f = fits["naive"], fits["fused_linear"]
        out.append(dict(target=f"peak memory naive/fused >= {TARGET_MEMORY}x at {n['target_tokens']} tokens "
                               f"(linear fit of the sweep, extrapolated)", value=n["extrapolated"] / f["extrapolated"],
                        ok=n["extrapolated"] / f["extrapolated"] >= TARGET_MEMORY))
        hidden = results["config"]["memory_shape"][0]
        bound = 2 * 4 * hidden + 256  # hidden-state gradient (+ its all-reduce copy) and [N] vectors: no [N, V] term
        out.append(dict(target=f"fused peak memory growth beyond one chunk <= {bound} bytes/token (2 x H x 4 + 256)",
                        value=f["bytes_per_token"], ok=f["bytes_per_token"] <= bound))
    return out


# ------------------------------------------------------------------------------------------------------ formatting
def _fmt(value: Optional[float], kind: str) -> str:
    if value is None:
        return "-"
    if kind == "mib":
        return f"{value / MIB:,.0f}"
    if kind == "ratio":
        return f"{value:.2f}x" if value >= 0.01 else f"{value:.1e}x"
    if kind == "err":
        return f"{value:.1e}"
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


COLUMNS = (  # header, key, kind
    ("model", "model", "str"), ("N", "tokens", "str"), ("path", "path", "str"),
    ("fwd tok/s", "fwd_tok_s", "num"), ("fwd / mm", "fwd_ratio", "ratio"),
    ("f+b tok/s", "fwdbwd_tok_s", "num"), ("f+b / mm", "fwdbwd_ratio", "ratio"),
    ("f+b GFLOP/s", "fwdbwd_gflops", "num"), ("peak fwd MiB", "fwd_peak", "mib"),
    ("peak f+b MiB", "fwdbwd_peak", "mib"), ("RSS f+b MiB", "fwdbwd_rss", "mib"),
    ("max dlogp err", "lp_err", "err"), ("grad rel err", "grad_err", "err"),
    ("loss grad err", "loss_grad_err", "err"),
)


def table_cells(results: dict) -> tuple[list[str], list[list[str]]]:
    rows = derived_rows(results)
    cells = [[str(r[k]) if kind == "str" else _fmt(r.get(k), kind) for _, k, kind in COLUMNS] for r in rows]
    return [h for h, _, _ in COLUMNS], cells


TERMINAL_COLUMNS = ("model", "N", "path", "fwd / mm", "f+b tok/s", "f+b / mm", "peak fwd MiB", "peak f+b MiB",
                    "max dlogp err", "grad rel err", "loss grad err")


def rich_table(results: dict):
    """The terminal table: the docs table without the GFLOP/s, fwd tok/s and RSS columns (they fit 130 columns)."""
    from rich.table import Table

    all_headers, all_cells = table_cells(results)
    keep = [all_headers.index(h) for h in TERMINAL_COLUMNS]
    headers, cells = [all_headers[i] for i in keep], [[row[i] for i in keep] for row in all_cells]
    table = Table(title="LM head -> log-prob -> PG loss (ratios to the bare GEMM of the same run)")
    for i, h in enumerate(headers):
        table.add_column(h, justify="left" if i < 3 else "right")
    for row in cells:
        table.add_row(*row)
    return table


def markdown_table(headers: list[str], cells: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in cells])


def write_json(results: dict, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=1))
    return path


__all__ = ["derived_rows", "markdown_table", "memory_fit", "rich_table", "table_cells", "targets", "write_json"]
