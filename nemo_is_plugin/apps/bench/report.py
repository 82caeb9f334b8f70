"""Derived numbers, targets, and the renderings of a benchmark result: rich table, JSON, markdown + PNG plots.

Conventions (stated in the docs too): ratios ("x GEMM") divide by the bare forward GEMM ``hidden @ W.T`` of the same
shape and run (1 GEMM: the forward limit; the recomputing fused forward+backward does 4, the naive one 3); effective
GFLOP/s counts 2NHV for a forward and 8NHV for a forward+backward whatever a path really executes (Liger's convention,
the CPU page); useful TFLOP/s counts 6NHV for a forward+backward (the 3 GEMMs without recompute, the GPU section);
memory is the peak of bytes allocated above the inputs (MiB = 2^20 bytes).

Which targets apply is decided here and only here: the CPU targets on a CPU run, the GPU targets on a CUDA run at the
GPU targets' setting (bf16, 16,384 tokens), none otherwise; ``comparability_note`` says why in words (a ``--quick``
run, a CPU run, a GPU run at another setting).
"""

from __future__ import annotations

import json
from pathlib import Path

from nemo_is_plugin.apps.bench.failures import FAILED_CELL, measurement_of
from nemo_is_plugin.apps.bench.shapes import GPU_TARGET_DTYPE, GPU_TARGET_TOKENS

MIB, GIB = 2**20, 2**30
TARGET_FWD, TARGET_FWDBWD, TARGET_MEMORY = 1.15, 4.4, 5.0
# GPU: forward+backward / one forward GEMM, per schedule; peak <= dW + dX (input dtype) + 1 GiB; numerics vs naive
TARGET_SINGLE_PASS, TARGET_TWO_PASS, TARGET_GPU_MEMORY_SLACK, NUMERICS_SLACK = 3.5, 4.5, GIB, 1.1
SINGLE_PASS_PATHS, TWO_PASS_PATHS = ("fused_linear", "fused_triton"), ("fused_2pass", "fused_2pass_triton")
DTYPE_BYTES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}
QUICK_NOTE = (
    "--quick: tiny shapes, a smoke run. These numbers only show that the benchmark runs; they are not "
    "meaningful as performance, so the performance targets are not evaluated (run without --quick)."
)


def derived_rows(results: dict) -> list[dict]:
    """The rows with ratios to the shape's matmul, tokens/s, effective GFLOP/s and useful TFLOP/s added."""
    matmul = {(r["model"], r["tokens"]): r["fwd_s"] for r in results["rows"] if r["path"] == "matmul"}
    out = []
    for r in results["rows"]:
        mm = matmul.get((r["model"], r["tokens"]))
        flops = 2 * r["tokens"] * r["hidden"] * r["vocab"]
        d = dict(r)
        for kind, factor in (("fwd", 1), ("fwdbwd", 4)):
            t = r[f"{kind}_s"]
            d[f"{kind}_ratio"] = None if t is None or not mm else t / mm
            d[f"{kind}_tok_s"] = None if t is None else r["tokens"] / t
            d[f"{kind}_gflops"] = None if t is None or r["path"] == "loss" else factor * flops / t / 1e9
        t = r["fwdbwd_s"]
        d["useful_tflops"] = None if t is None or r["path"] == "loss" else 3 * flops / t / 1e12
        out.append(d)
    return out


def is_gpu_run(results: dict) -> bool:
    return results["config"].get("device", "cpu") == "cuda"


def is_gpu_target_run(results: dict) -> bool:
    """A real GPU run at the setting the GPU targets are defined for."""
    cfg = results["config"]
    return (
        is_gpu_run(results)
        and not cfg.get("quick")
        and cfg["tokens"] == GPU_TARGET_TOKENS
        and cfg.get("dtype") == GPU_TARGET_DTYPE
    )


def comparability_note(results: dict) -> str | None:
    """Why this run's numbers cannot be held against the GPU targets (None: they can). The one place that says so."""
    cfg = results["config"]
    if cfg.get("quick"):
        return QUICK_NOTE
    if not is_gpu_run(results):
        return (
            f"CPU run: not comparable to the GPU targets (H100/H200, {GPU_TARGET_DTYPE}, {GPU_TARGET_TOKENS:,} "
            "tokens). CPU ratios do not carry over to GPUs; the targets below are the CPU ones."
        )
    if not is_gpu_target_run(results):
        return (
            f"GPU run at {cfg['tokens']:,} tokens in {cfg.get('dtype')}: the GPU targets are defined at "
            f"{GPU_TARGET_TOKENS:,} {GPU_TARGET_DTYPE} tokens and are not checked here."
        )
    return None


def gpu_memory_bound(row: dict, dtype: str) -> int:
    """dW in the weight's dtype + dX in the hidden states' dtype + 1 GiB, bytes."""
    return (row["vocab"] + row["tokens"]) * row["hidden"] * DTYPE_BYTES[dtype] + TARGET_GPU_MEMORY_SLACK


def gpu_targets(results: dict) -> list[dict]:
    """The GPU targets per shape and plugin row, only for a run at their setting (else empty)."""
    if not is_gpu_target_run(results):
        return []
    rows, out = derived_rows(results), []
    dtype = results["config"]["dtype"]
    naive = {r["model"]: r for r in rows if r["path"] == "naive"}
    for r in rows:
        limit = TARGET_SINGLE_PASS if r["path"] in SINGLE_PASS_PATHS else TARGET_TWO_PASS
        if r["path"] not in SINGLE_PASS_PATHS + TWO_PASS_PATHS or r["fwdbwd_ratio"] is None:
            continue
        schedule = "single pass" if r["path"] in SINGLE_PASS_PATHS else "two pass"
        out.append(
            dict(
                target=f"{r['model']}: {r['path']} ({schedule}) forward+backward <= {limit}x GEMM",
                value=r["fwdbwd_ratio"],
                ok=r["fwdbwd_ratio"] <= limit,
            )
        )
        bound = gpu_memory_bound(r, dtype)
        out.append(
            dict(
                target=f"{r['model']}: {r['path']} peak <= dW + dX + 1 GiB = {bound / GIB:.2f} GiB (value in GiB)",
                value=r["fwdbwd_peak"] / GIB,
                ok=r["fwdbwd_peak"] <= bound,
            )
        )
        base = naive.get(r["model"])
        for key, label in (("loss_err", "loss"), ("dx_err", "dX")):
            if base is None or r.get(key) is None or base.get(key) is None:
                continue
            ok = r[key] <= NUMERICS_SLACK * base[key] + 1e-7
            out.append(
                dict(
                    target=f"{r['model']}: {r['path']} {label} error vs fp32 <= naive bf16's "
                    f"({base[key]:.2g}; x{NUMERICS_SLACK} measurement slack)",
                    value=r[key],
                    ok=ok,
                )
            )
    return out


def run_targets(results: dict) -> list[dict]:
    """The targets that apply to this run: none for a --quick run (tiny shapes time launch overheads, not the LM
    head), GPU targets on a CUDA run (possibly none), CPU targets on a CPU run."""
    if results["config"].get("quick"):
        return []
    return gpu_targets(results) if is_gpu_run(results) else targets(results)


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
        fits[path] = dict(
            bytes_per_token=slope,
            intercept=m2 - slope * n2,
            tokens=n2,
            measured=m2,
            extrapolated=m2 + slope * (target - n2),
            target_tokens=target,
        )
    return fits


def targets(results: dict) -> list[dict]:
    """The benchmark's CPU-checkable targets, each with the measured value and whether it holds."""
    rows, out = derived_rows(results), []
    timed = [r for r in rows if r["fwd_s"] is not None and r["fwdbwd_s"] is not None]  # failed rows: failure_lines
    fused = [r for r in timed if r["path"] == "fused_linear"]
    naive = {r["model"]: r for r in timed if r["path"] == "naive"}
    for r in fused:
        out.append(
            dict(
                target=f"{r['model']}: fused forward <= {TARGET_FWD}x matmul",
                value=r["fwd_ratio"],
                ok=r["fwd_ratio"] <= TARGET_FWD,
            )
        )
        out.append(
            dict(
                target=f"{r['model']}: fused forward+backward <= {TARGET_FWDBWD}x matmul",
                value=r["fwdbwd_ratio"],
                ok=r["fwdbwd_ratio"] <= TARGET_FWDBWD,
            )
        )
        if r["model"] in naive:
            nv = naive[r["model"]]
            out.append(
                dict(
                    target=f"{r['model']}: fused forward faster than naive (time ratio fused/naive)",
                    value=r["fwd_s"] / nv["fwd_s"],
                    ok=r["fwd_s"] < nv["fwd_s"],
                )
            )
            out.append(
                dict(
                    target=f"{r['model']}: fused forward+backward faster than naive (time ratio)",
                    value=r["fwdbwd_s"] / nv["fwdbwd_s"],
                    ok=r["fwdbwd_s"] < nv["fwdbwd_s"],
                )
            )
    for r in (r for r in rows if r["path"] == "fused_2pass" and r["fwdbwd_s"] is not None):
        out.append(
            dict(
                target=f"{r['model']}: two-pass fused forward+backward <= {TARGET_FWDBWD}x matmul "
                "(sequence-level ratios)",
                value=r["fwdbwd_ratio"],
                ok=r["fwdbwd_ratio"] <= TARGET_FWDBWD,
            )
        )
    direct = {p["path"]: p for p in results.get("memory_direct", [])}
    if "naive" in direct and "fused_linear" in direct:
        n, f = direct["naive"], direct["fused_linear"]
        ratio = n["peak_bytes"] / f["peak_bytes"]
        out.append(
            dict(
                target=f"peak memory naive/fused >= {TARGET_MEMORY}x at {n['tokens']} tokens (measured)",
                value=ratio,
                ok=ratio >= TARGET_MEMORY,
            )
        )
    fits = memory_fit(results)
    if "naive" in fits and "fused_linear" in fits:
        n, f = fits["naive"], fits["fused_linear"]
        out.append(
            dict(
                target=f"peak memory naive/fused >= {TARGET_MEMORY}x at {n['target_tokens']} tokens "
                f"(linear fit of the sweep, extrapolated)",
                value=n["extrapolated"] / f["extrapolated"],
                ok=n["extrapolated"] / f["extrapolated"] >= TARGET_MEMORY,
            )
        )
        hidden = results["config"]["memory_shape"][0]
        bound = 2 * 4 * hidden + 256  # hidden-state gradient (+ its all-reduce copy) and [N] vectors: no [N, V] term
        out.append(
            dict(
                target=f"fused peak memory growth beyond one chunk <= {bound} bytes/token (2 x H x 4 + 256)",
                value=f["bytes_per_token"],
                ok=f["bytes_per_token"] <= bound,
            )
        )
    return out


# ------------------------------------------------------------------------------------------------------ formatting
def format_value(value: float | str | None, kind: str) -> str:
    """One table cell of ``kind`` (str, mib, gib, ms, ratio, err, num); ``-`` where nothing was measured."""
    if value is None:
        return "-"
    if kind == "str" or isinstance(value, str):
        return str(value)
    if kind == "mib":
        return f"{value / MIB:,.0f}"
    if kind == "gib":
        return f"{value / GIB:.3g}"
    if kind == "ms":
        return f"{value * 1e3:,.1f}"
    if kind == "ratio":
        return f"{value:.2f}x" if value >= 0.01 else f"{value:.1e}x"
    if kind == "err":
        return f"{value:.1e}"
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


COLUMNS = (  # header, key, kind
    ("model", "model", "str"),
    ("N", "tokens", "str"),
    ("path", "path", "str"),
    ("backend", "backend", "str"),
    ("fwd tok/s", "fwd_tok_s", "num"),
    ("fwd / mm", "fwd_ratio", "ratio"),
    ("f+b tok/s", "fwdbwd_tok_s", "num"),
    ("f+b / mm", "fwdbwd_ratio", "ratio"),
    ("f+b GFLOP/s", "fwdbwd_gflops", "num"),
    ("peak fwd MiB", "fwd_peak", "mib"),
    ("peak f+b MiB", "fwdbwd_peak", "mib"),
    ("RSS f+b MiB", "fwdbwd_rss", "mib"),
    ("max dlogp err", "lp_err", "err"),
    ("grad rel err", "grad_err", "err"),
    ("loss grad err", "loss_grad_err", "err"),
    ("loss err", "loss_err", "err"),
    ("dX err", "dx_err", "err"),
)
GPU_COLUMNS = (  # header, key, kind
    ("model", "model", "str"),
    ("path", "path", "str"),
    ("backend", "backend", "str"),
    ("fwd x GEMM", "fwd_ratio", "ratio"),
    ("f+b x GEMM", "fwdbwd_ratio", "ratio"),
    ("f+b ms", "fwdbwd_s", "ms"),
    ("useful TFLOP/s", "useful_tflops", "num"),
    ("peak f+b GiB", "fwdbwd_peak", "gib"),
    ("loss err", "loss_err", "err"),
    ("dX err", "dx_err", "err"),
    ("dW err", "dw_err", "err"),
)


def _cell(row: dict, key: str, kind: str) -> str:
    """A value, ``-`` where nothing was measured, ``failed`` where its measurement raised (``failure_lines``)."""
    value = row.get(key)
    if value is None and measurement_of(key) in (row.get("failed") or {}):
        return FAILED_CELL
    return format_value(value, kind)


def table_cells(results: dict, columns=COLUMNS) -> tuple[list[str], list[list[str]]]:
    rows = derived_rows(results)
    cells = [[_cell(r, k, kind) for _, k, kind in columns] for r in rows]
    return [h for h, _, _ in columns], cells


TERMINAL_COLUMNS = (
    "model",
    "N",
    "path",
    "backend",
    "fwd / mm",
    "f+b tok/s",
    "f+b / mm",
    "peak fwd MiB",
    "peak f+b MiB",
    "max dlogp err",
    "grad rel err",
    "loss grad err",
)


def rich_table(results: dict):
    """The terminal table. CPU: the docs table without the GFLOP/s, fwd tok/s, RSS and full-problem error columns
    (they fit 130 columns); GPU: the GPU section's columns."""
    from rich.table import Table

    if is_gpu_run(results):
        headers, cells = table_cells(results, GPU_COLUMNS)
    else:
        all_headers, all_cells = table_cells(results)
        keep = [all_headers.index(h) for h in TERMINAL_COLUMNS]
        headers, cells = [all_headers[i] for i in keep], [[row[i] for i in keep] for row in all_cells]
    table = Table(title="LM head -> log-prob -> PG loss (ratios to the bare GEMM of the same run)")
    n_text = 3 if is_gpu_run(results) else 4
    for i, h in enumerate(headers):
        table.add_column(h, justify="left" if i < n_text else "right")
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


__all__ = [
    "GPU_COLUMNS",
    "QUICK_NOTE",
    "comparability_note",
    "derived_rows",
    "gpu_memory_bound",
    "gpu_targets",
    "is_gpu_run",
    "is_gpu_target_run",
    "markdown_table",
    "memory_fit",
    "rich_table",
    "run_targets",
    "table_cells",
    "targets",
    "write_json",
]
