"""``nemo-is bench --host-heads``: the hosts' fused LM heads (NeMo-RL's, verl's) against the plugin's, with a progress
bar; prints the table and the targets (:mod:`nemo_is_plugin.apps.bench.host_heads_report`) and writes
``host_heads.json`` (from which ``python -m tools.bench_docs host-heads`` writes the project's docs section)."""

from __future__ import annotations

from pathlib import Path

from nemo_is_plugin.apps.cli.bench_common import BenchRun, print_note, print_targets, print_written, selected_shapes


def host_heads_command(
    console,
    run: BenchRun,
    *,
    models: list[str] | None,
    heads: list[str] | None,
    tp: int,
    nemo_rl_path: Path | None,
    verl_path: Path | None,
) -> None:
    from rich.markup import escape

    from nemo_is_plugin.apps.bench.host_heads import HostHeadsConfig
    from nemo_is_plugin.apps.bench.host_heads_report import comparability_note, failure_lines, rich_table, targets
    from nemo_is_plugin.apps.bench.host_heads_run import count_steps, run_host_heads
    from nemo_is_plugin.apps.bench.report import write_json

    def configure() -> HostHeadsConfig:
        return HostHeadsConfig.for_device(
            run.device,
            **run.for_device_options(),
            tp=tp,
            shapes=selected_shapes(run.quick, models),
            heads=tuple(heads) if heads else None,
            nemo_rl_path=None if nemo_rl_path is None else str(nemo_rl_path),
            verl_path=None if verl_path is None else str(verl_path),
        )

    results = run.saved_or_measured(console, configure, count_steps, run_host_heads)
    console.print(rich_table(results))
    for line in failure_lines(results):
        console.print(f"[yellow]{escape(line)}[/yellow]")
    print_note(console, comparability_note(results))
    print_targets(console, targets(results))
    print_written(console, [write_json(results, run.out / "host_heads.json")])


__all__ = ["host_heads_command"]
