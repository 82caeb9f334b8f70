"""``nemo-is bench``: LM head -> log-prob -> PG loss benchmark of the naive, from-logits, fused-linear (one and two
passes, torch and Triton backends), Liger and cut-cross-entropy paths against the bare GEMM, on CPU or CUDA; with
``--model-step``, training steps of a megatron-core MoE GPT model with the naive and the fused loss
(``cli/bench_model_step.py``); with ``--host-heads``, the hosts' own fused LM heads against the plugin's
(``cli/bench_host_heads.py``); with ``--score-centering-head``, the LM-head paths with score centering's k head ids
per token against the same paths without them (``cli/bench_head_cost.py``). Prints a rich table, writes JSON + PNG
(the project's ``docs/performance.md`` is written from that JSON by its tooling, ``python -m tools.bench_docs``,
outside the installed package). Heavy imports (torch, matplotlib, liger, megatron) happen inside the command."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from nemo_is_plugin.apps.cli.bench_common import (
    BenchRun,
    print_note,
    print_targets,
    print_written,
    selected_shapes,
    usage_error,
)
from nemo_is_plugin.apps.cli.bench_head_cost import head_cost_command
from nemo_is_plugin.apps.cli.bench_host_heads import host_heads_command
from nemo_is_plugin.apps.cli.bench_model_step import model_step_command


def register(app: typer.Typer) -> None:
    app.command("bench")(bench)


def bench(
    tokens: int | None = typer.Option(
        None,
        help="Tokens per measurement. Default: 256 on CPU (scaled down), 16384 = 8 x 2048 on CUDA, 64 with "
        "--quick; with --model-step the batch's tokens (default 4 x 2048 on CUDA).",
    ),
    models: list[str] | None = typer.Option(None, "--model", help="Model shape(s) to run (default: all four)."),
    paths: list[str] | None = typer.Option(
        None,
        "--path",
        help="Path(s): naive, from_logits, fused_linear, fused_2pass, fused_triton, "
        "fused_2pass_triton, liger, cce. Default: all on CUDA; on CPU the first four and liger.",
    ),
    chunk_size: int | None = typer.Option(None, help="Tokens per chunk of the chunked paths (default: theirs)."),
    tp: int = typer.Option(1, help="Vocab shards: measure one TP rank's local work on V/tp rows of the head."),
    repeats: int | None = typer.Option(
        None, help="Timing rounds after the warm-up (CPU: best round reported, default 3; CUDA: median, default 5)."
    ),
    memory_tokens: list[int] | None = typer.Option(None, "--memory-tokens", help="Token counts of the sweep."),
    no_memory_sweep: bool = typer.Option(
        False, "--no-memory-sweep", help="Skip the memory-vs-tokens sweep (CPU runs)."
    ),
    threads: int = typer.Option(1, help="torch intra-op threads."),
    quick: bool = typer.Option(
        False, "--quick", help="Tiny shapes: a seconds-long smoke run (numbers not meaningful)."
    ),
    device: str = typer.Option("cpu", help="cpu or cuda."),
    dtype: str | None = typer.Option(None, help="Input dtype: float32 (CPU default), bfloat16 (CUDA default)."),
    model_step: bool = typer.Option(
        False,
        "--model-step",
        help="Training steps of a megatron-core MoE GPT model with the naive and the fused loss, instead of the head.",
    ),
    layers: int | None = typer.Option(None, help="--model-step: transformer layers (default 2)."),
    experts: int | None = typer.Option(None, help="--model-step: routed experts per layer (default 16, top-4)."),
    host_heads: bool = typer.Option(
        False,
        "--host-heads",
        help="The hosts' own fused LM heads (NeMo-RL's, verl's) against the plugin's drop-ins for them, instead.",
    ),
    heads: list[str] | None = typer.Option(None, "--head", help="--host-heads: head(s) to run (default: all)."),
    score_centering_head: bool = typer.Option(
        False,
        "--score-centering-head",
        help="The cost of score centering's head (the log-probs of k sampler top-k ids per token, same pass): the "
        "from_logits, fused_2pass and fused_linear heads with k ids against the same heads without them.",
    ),
    head_ks: list[int] | None = typer.Option(
        None, "--head-k", help="--score-centering-head: head sizes k (default 32 and 128; k = 0 always runs)."
    ),
    nemo_rl_path: Path | None = typer.Option(
        None, help="--host-heads: a NeMo-RL checkout (the directory holding nemo_rl/) when NeMo-RL is not installed."
    ),
    verl_path: Path | None = typer.Option(
        None, help="--host-heads: a verl checkout (the directory holding verl/) instead of the installed verl."
    ),
    out: Path = typer.Option(Path("bench_results"), help="Directory for results.json and the PNG figures."),
    from_json: list[Path] | None = typer.Option(
        None,
        help="Render an earlier run's results.json instead of measuring; given several times, the runs' rows "
        "(one setting, different models) in one table.",
    ),
) -> None:
    """Benchmark the log-prob + loss paths at MoE LM-head shapes; prints the table, writes JSON and plots."""
    from rich.console import Console

    from nemo_is_plugin.apps.cli.paths import check_paths

    check_paths("bench", [(out, "--out", "output_dir"), *((p, "--from-json", "input_file") for p in from_json or ())])
    console = Console()
    if not console.is_terminal:  # piped / captured: do not squeeze the table into 80 columns
        console = Console(width=max(console.width, 130))
    run = BenchRun(device, dtype, quick, tokens, repeats, out, tuple(from_json or ()))
    if score_centering_head:
        head_cost_command(console, run, models=models, paths=paths, ks=head_ks, chunk_size=chunk_size, threads=threads)
    elif host_heads:
        host_heads_command(
            console, run, models=models, heads=heads, tp=tp, nemo_rl_path=nemo_rl_path, verl_path=verl_path
        )
    elif model_step:
        model_step_command(console, run, layers=layers, experts=experts, chunk_size=chunk_size)
    else:
        _head_paths_command(console, run, models, paths, chunk_size, tp, memory_tokens, not no_memory_sweep, threads)


def _head_paths_command(console, run: BenchRun, models, paths, chunk_size, tp, memory_tokens, memory_sweep, threads):
    """The head paths: their config (checked even when earlier runs are rendered), the earlier runs' rows merged or
    a measurement, the report. A bad option or an unmergeable set of runs is a usage error."""
    try:
        cfg = _config(run, models, paths, chunk_size, tp, memory_tokens, memory_sweep, threads)
        merged = _merged(run.from_json) if run.from_json else None
    except ValueError as exc:
        raise usage_error(console, exc) from exc
    _report(merged if merged is not None else _measured(cfg, console), console, run.out)


def _config(run: BenchRun, models, paths, chunk_size, tp, memory_tokens, memory_sweep, threads):
    from nemo_is_plugin.apps.bench.device import BenchDevice
    from nemo_is_plugin.apps.bench.shapes import PATHS, BenchConfig

    BenchDevice.resolve(run.device, run.dtype)  # a usage error (no CUDA here, unknown dtype) before anything runs
    overrides: dict = dict(tp=tp, threads=threads, dtype=run.dtype)
    for key, value in (("tokens", run.tokens), ("repeats", run.repeats), ("chunk_size", chunk_size)):
        if value is not None:
            overrides[key] = value
    if paths:
        overrides["paths"] = tuple(paths)
        if unknown := [p for p in paths if p not in PATHS]:
            raise ValueError(f"unknown path(s) {unknown}; choose from {list(PATHS)}")
    if memory_tokens:
        overrides["memory_tokens"] = tuple(memory_tokens)
    if not memory_sweep:
        overrides["memory_tokens"] = ()
    if shapes := selected_shapes(run.quick, models):
        overrides["shapes"] = shapes
    return BenchConfig.for_device(run.device, quick=run.quick, **overrides)


def _merged(from_json: tuple[Path, ...]) -> dict:
    """The rows of earlier runs' results.json files in one result (one setting, different models)."""
    from nemo_is_plugin.apps.bench.merge import merge_results

    return merge_results([json.loads(p.read_text()) for p in from_json])


def _measured(cfg, console) -> dict:
    from nemo_is_plugin.apps.bench.progress import progress_bar
    from nemo_is_plugin.apps.bench.runner import count_steps, run_benchmark

    with progress_bar(console, count_steps(cfg)) as progress:
        return run_benchmark(cfg, progress)


def _report(results: dict, console, out: Path) -> None:
    from rich.markup import escape

    from nemo_is_plugin.apps.bench.failures import failure_lines, fallback_note
    from nemo_is_plugin.apps.bench.plots import plot_memory, plot_ratios
    from nemo_is_plugin.apps.bench.report import comparability_note, rich_table, run_targets, write_json

    console.print(rich_table(results))
    for name, why in results["skipped"].items():
        console.print(f"[yellow]not measured: {escape(name)}:[/yellow] {escape(why)}")
    for line in failure_lines(results):
        console.print(f"[red]failed:[/red] {escape(line)}")
    if note := fallback_note(results):
        console.print(f"[bold red]note:[/bold red] {escape(note)}")
    print_note(console, comparability_note(results))
    print_targets(console, run_targets(results))
    written = [write_json(results, out / "results.json"), plot_ratios(results, out / "perf_ratios.png")]
    if results["memory_sweep"]:
        written.append(plot_memory(results, out / "perf_memory.png"))
    print_written(console, written)


__all__ = ["bench", "register"]
