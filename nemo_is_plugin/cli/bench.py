"""``nemo-is bench``: LM head -> log-prob -> PG loss benchmark of the naive, from-logits, fused-linear (one and two
passes) and Liger paths against the bare GEMM. Prints a rich table, writes JSON + PNG, and with ``--write-docs``
regenerates ``docs/performance.md``. Heavy imports (torch, matplotlib, liger) happen inside the command."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer


def register(app: typer.Typer) -> None:
    app.command("bench")(bench)


def bench(
    tokens: int = typer.Option(256, help="Tokens per measurement (scaled to this machine; ratios carry over)."),
    models: Optional[list[str]] = typer.Option(None, "--model", help="Model shape(s) to run (default: all four)."),
    paths: Optional[list[str]] = typer.Option(
        None, "--path", help="Path(s): naive, from_logits, fused_linear, fused_2pass, liger."
    ),
    chunk_size: Optional[int] = typer.Option(None, help="Tokens per chunk of the chunked paths (default: theirs)."),
    tp: int = typer.Option(1, help="Vocab shards: measure one TP rank's local work on V/tp rows of the head."),
    repeats: int = typer.Option(3, help="Timing rounds after the memory-tracked warm-up (best round reported)."),
    memory_tokens: Optional[list[int]] = typer.Option(None, "--memory-tokens", help="Token counts of the sweep."),
    no_memory_sweep: bool = typer.Option(False, "--no-memory-sweep", help="Skip the memory-vs-tokens sweep."),
    threads: int = typer.Option(1, help="torch intra-op threads."),
    quick: bool = typer.Option(False, "--quick",
                               help="Tiny shapes: a seconds-long smoke run (numbers are not meaningful)."),
    out: Path = typer.Option(Path("bench_results"), help="Directory for results.json and the PNG figures."),
    write_docs: bool = typer.Option(False, "--write-docs",
                                    help="Also regenerate docs/performance.md and docs/img/perf_*.png."),
    docs_dir: Path = typer.Option(Path("docs"), help="Docs directory used by --write-docs."),
    from_json: Optional[Path] = typer.Option(None, help="Render an earlier run's results.json instead of measuring."),
) -> None:
    """Benchmark the log-prob + loss paths at MoE LM-head shapes; prints the table, writes JSON and plots."""
    from rich.console import Console

    from nemo_is_plugin.bench.shapes import MODEL_SHAPES, PATHS, QUICK_SHAPES, BenchConfig

    console = Console()
    if not console.is_terminal:  # piped / captured: do not squeeze the table into 80 columns
        console = Console(width=max(console.width, 130))
    overrides: dict = dict(tp=tp, repeats=repeats, threads=threads)
    if chunk_size is not None:
        overrides["chunk_size"] = chunk_size
    if paths:
        overrides["paths"] = tuple(paths)
    if memory_tokens:
        overrides["memory_tokens"] = tuple(memory_tokens)
    if no_memory_sweep:
        overrides["memory_tokens"] = ()
    try:
        known = {s.name: s for s in (QUICK_SHAPES if quick else MODEL_SHAPES)}
        missing = [m for m in models or () if m not in known]
        if missing:
            raise ValueError(f"unknown model(s) {missing}; choose from {list(known)}")
        if models:
            overrides["shapes"] = tuple(known[m] for m in models)
        cfg = BenchConfig.quick(**overrides) if quick else BenchConfig(tokens=tokens, **overrides)
    except ValueError as exc:
        console.print(f"[red]error:[/red] {exc} (paths: {', '.join(PATHS)})")
        raise typer.Exit(code=2) from exc

    if from_json is not None:
        results = json.loads(from_json.read_text())
    else:
        results = _run_with_progress(cfg, console)
    _report(results, console, out, write_docs, docs_dir, quick)


def _run_with_progress(cfg, console) -> dict:
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from nemo_is_plugin.bench.runner import count_steps, run_benchmark

    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), console=console, transient=True) as bar:
        task = bar.add_task("starting", total=count_steps(cfg))
        state = {"started": False}

        def progress(label: str) -> None:
            if state["started"]:
                bar.advance(task)
            state["started"] = True
            bar.update(task, description=label)
            if not console.is_terminal:  # a log file gets one line per step instead of a live bar
                console.log(label)

        results = run_benchmark(cfg, progress)
        bar.advance(task)
    return results


def _report(results: dict, console, out: Path, write_docs: bool, docs_dir: Path, quick: bool = False) -> None:
    from nemo_is_plugin.bench.docs import write_docs as write_docs_fn
    from nemo_is_plugin.bench.plots import plot_memory, plot_ratios
    from nemo_is_plugin.bench.report import rich_table, targets, write_json

    console.print(rich_table(results))
    for name, why in results["skipped"].items():
        console.print(f"[yellow]skipped {name}:[/yellow] {why}")
    if quick:  # tiny shapes time launch overheads, not the LM head: a target verdict would mean nothing
        console.print(f"[yellow]--quick: tiny shapes, a smoke run; its timings and memory are not meaningful, so the "
                      f"{len(targets(results))} performance targets are not evaluated (run without --quick).[/yellow]")
    else:
        for t in targets(results):
            mark = "[green]ok[/green]" if t["ok"] else "[red]no[/red]"
            console.print(f"{mark}  {t['target']}: {t['value']:.3g}")
    written = [write_json(results, out / "results.json"), plot_ratios(results, out / "perf_ratios.png")]
    if results["memory_sweep"]:
        written.append(plot_memory(results, out / "perf_memory.png"))
    if write_docs:
        written += write_docs_fn(results, docs_dir)
    console.print("wrote " + ", ".join(str(p) for p in written))


__all__ = ["bench", "register"]
