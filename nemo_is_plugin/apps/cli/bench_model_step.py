"""``nemo-is bench --model-step``: training steps of a megatron-core MoE GPT model with the naive and the fused loss
(:mod:`nemo_is_plugin.apps.bench.model_step`), with a progress bar; prints the table, writes ``model_step.json``."""

from __future__ import annotations

from nemo_is_plugin.apps.cli.bench_common import BenchRun, print_note, print_written, usage_error


def model_step_command(console, run: BenchRun, *, layers: int | None, experts: int | None, chunk_size: int | None):
    from rich.markup import escape

    from nemo_is_plugin.apps.bench.model_report import model_step_table
    from nemo_is_plugin.apps.bench.model_step import StepConfig, count_model_steps, run_model_step
    from nemo_is_plugin.apps.bench.report import QUICK_NOTE, write_json

    if len(run.from_json) > 1:
        raise usage_error(
            console, ValueError("--model-step renders one model_step.json (--from-json given more than once)")
        )

    def configure() -> StepConfig:
        extra = {"repeats": run.repeats} if run.repeats is not None else {}
        return StepConfig.for_device(
            run.device,
            quick=run.quick,
            tokens=run.tokens,
            layers=layers,
            experts=experts,
            dtype=run.dtype,
            chunk_size=chunk_size,
            **extra,
        )

    results = run.saved_or_measured(console, configure, count_model_steps, run_model_step)
    console.print(model_step_table(results))
    for name, why in results.get("skipped", {}).items():
        console.print(f"[yellow]not measured: {name}:[/yellow] {escape(why)}")
    print_note(console, QUICK_NOTE if results["config"].get("quick") else None)
    print_written(console, [write_json(results, run.out / "model_step.json")])


__all__ = ["model_step_command"]
