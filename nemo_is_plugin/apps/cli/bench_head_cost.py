"""``nemo-is bench --score-centering-head``: the LM-head paths with score centering's k head ids per token against
the same paths without them (:mod:`nemo_is_plugin.apps.bench.head_cost`), with a progress bar; prints the table and
the k = 32 target, writes ``head_cost.json``."""

from __future__ import annotations

from nemo_is_plugin.apps.cli.bench_common import BenchRun, print_note, print_targets, print_written, selected_shapes


def head_cost_command(
    console,
    run: BenchRun,
    *,
    models: list[str] | None,
    paths: list[str] | None,
    ks: list[int] | None,
    chunk_size: int | None,
    threads: int,
) -> None:
    from nemo_is_plugin.apps.bench.head_cost import (
        HeadCostConfig,
        count_steps,
        head_cost_table,
        head_cost_targets,
        run_head_cost,
    )
    from nemo_is_plugin.apps.bench.report import QUICK_NOTE, write_json

    def configure() -> HeadCostConfig:
        return HeadCostConfig.for_device(
            run.device,
            **run.for_device_options(),
            shapes=selected_shapes(run.quick, models),
            paths=tuple(paths) if paths else None,
            ks=tuple(ks) if ks else None,
            chunk_size=chunk_size,
            threads=threads,
        )

    results = run.saved_or_measured(console, configure, count_steps, run_head_cost)
    console.print(head_cost_table(results))
    print_note(console, QUICK_NOTE if results["config"].get("quick") else None)
    print_targets(console, head_cost_targets(results))
    print_written(console, [write_json(results, run.out / "head_cost.json")])


__all__ = ["head_cost_command"]
