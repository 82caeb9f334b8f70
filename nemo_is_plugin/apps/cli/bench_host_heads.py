"""``nemo-is bench --host-heads``: the hosts' fused LM heads (NeMo-RL's, verl's) against the plugin's, with a progress
bar; prints the table and the targets (:mod:`nemo_is_plugin.apps.bench.host_heads_report`) and writes
``host_heads.json`` (from which ``python -m tools.bench_docs host-heads`` writes the project's docs section)."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from nemo_is_plugin.apps.cli.bench_common import print_targets, selected_shapes


def host_heads_command(
    console,
    *,
    device: str,
    dtype: str | None,
    quick: bool,
    tokens: int | None,
    repeats: int | None,
    models: list[str] | None,
    heads: list[str] | None,
    tp: int,
    nemo_rl_path: Path | None,
    verl_path: Path | None,
    out: Path,
    from_json: Path | None,
) -> None:
    from rich.markup import escape

    from nemo_is_plugin.apps.bench.host_heads_report import comparability_note, failure_lines, rich_table, targets
    from nemo_is_plugin.apps.bench.report import write_json

    if from_json is not None:
        results = json.loads(from_json.read_text())
    else:
        results = _measure(console, device, dtype, quick, tokens, repeats, models, heads, tp, nemo_rl_path, verl_path)
    console.print(rich_table(results))
    for line in failure_lines(results):
        console.print(f"[yellow]{escape(line)}[/yellow]")
    if note := comparability_note(results):
        console.print(f"[bold yellow]note:[/bold yellow] {escape(note)}")
    print_targets(console, targets(results))
    written = [write_json(results, out / "host_heads.json")]
    console.print("wrote " + ", ".join(str(p) for p in written))


def _measure(console, device, dtype, quick, tokens, repeats, models, heads, tp, nemo_rl_path, verl_path) -> dict:
    from rich.markup import escape

    from nemo_is_plugin.apps.bench.device import BenchDevice
    from nemo_is_plugin.apps.bench.host_heads import HostHeadsConfig
    from nemo_is_plugin.apps.bench.host_heads_run import count_steps, run_host_heads
    from nemo_is_plugin.apps.bench.progress import progress_bar

    try:
        BenchDevice.resolve(device, dtype)
        cfg = HostHeadsConfig.for_device(
            device,
            quick=quick,
            tokens=tokens,
            repeats=repeats,
            tp=tp,
            dtype=dtype,
            shapes=selected_shapes(quick, models),
            heads=tuple(heads) if heads else None,
            nemo_rl_path=None if nemo_rl_path is None else str(nemo_rl_path),
            verl_path=None if verl_path is None else str(verl_path),
        )
    except ValueError as exc:
        console.print(f"[red]error:[/red] {escape(str(exc))}")
        raise typer.Exit(code=2) from exc
    with progress_bar(console, count_steps(cfg)) as progress:
        return run_host_heads(cfg, progress)


__all__ = ["host_heads_command"]
