"""``nemo-is bench --score-centering-head``: the LM-head paths with score centering's k head ids per token against
the same paths without them (:mod:`nemo_is_plugin.apps.bench.head_cost`), with a progress bar; prints the table and
the k = 32 target, writes ``head_cost.json``."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from nemo_is_plugin.apps.cli.bench_common import print_targets, selected_shapes


def head_cost_command(
    console,
    *,
    device: str,
    dtype: str | None,
    quick: bool,
    tokens: int | None,
    repeats: int | None,
    models: list[str] | None,
    paths: list[str] | None,
    ks: list[int] | None,
    chunk_size: int | None,
    threads: int,
    out: Path,
    from_json: Path | None,
) -> None:
    from rich.markup import escape

    from nemo_is_plugin.apps.bench.head_cost import head_cost_table, head_cost_targets
    from nemo_is_plugin.apps.bench.report import QUICK_NOTE, write_json

    if from_json is not None:
        results = json.loads(from_json.read_text())
    else:
        results = _measure(console, device, dtype, quick, tokens, repeats, models, paths, ks, chunk_size, threads)
    console.print(head_cost_table(results))
    if results["config"].get("quick"):
        console.print(f"[bold yellow]note:[/bold yellow] {escape(QUICK_NOTE)}")
    print_targets(console, head_cost_targets(results))
    console.print(f"wrote {write_json(results, out / 'head_cost.json')}")


def _measure(console, device, dtype, quick, tokens, repeats, models, paths, ks, chunk_size, threads) -> dict:
    from rich.markup import escape

    from nemo_is_plugin.apps.bench.device import BenchDevice
    from nemo_is_plugin.apps.bench.head_cost import HeadCostConfig, count_steps, run_head_cost
    from nemo_is_plugin.apps.bench.progress import progress_bar

    try:
        BenchDevice.resolve(device, dtype)
        cfg = HeadCostConfig.for_device(
            device,
            quick=quick,
            tokens=tokens,
            repeats=repeats,
            shapes=selected_shapes(quick, models),
            paths=tuple(paths) if paths else None,
            ks=tuple(ks) if ks else None,
            chunk_size=chunk_size,
            dtype=dtype,
            threads=threads,
        )
    except ValueError as exc:
        console.print(f"[red]error:[/red] {escape(str(exc))}")
        raise typer.Exit(code=2) from exc
    with progress_bar(console, count_steps(cfg)) as progress:
        return run_head_cost(cfg, progress)


__all__ = ["head_cost_command"]
