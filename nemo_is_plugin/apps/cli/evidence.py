"""``nemo-is evidence``: recompute the seeds' numerical claims with the plugin's own functions; write PNGs + JSON.

Registered on the main app by ``cli/main.py`` through :func:`register`. torch / matplotlib are imported inside the
command so that ``nemo-is --help`` stays fast.
"""

from __future__ import annotations

from pathlib import Path

import typer

_EXIT_BAD_INPUT = 2


def register(app: typer.Typer) -> None:
    """Add the ``evidence`` command to ``app``."""

    @app.command("evidence")
    def evidence_cmd(
        output_dir: Path = typer.Option(
            Path("runs/evidence"),
            "--output-dir",
            "-o",
            help="Directory for the evidence_*.png figures and evidence_numbers.json (docs/img regenerates the "
            "repository's own figures).",
        ),
        quick: bool = typer.Option(False, "--quick", help="Small Monte Carlo sizes (seconds; noisier numbers)."),
        seed: int = typer.Option(0, help="Seed of every random draw; the same seed reproduces the same files."),
        only: list[str] | None = typer.Option(
            None,
            "--only",
            help="Run only this experiment (repeatable): is_collapse, ctpo_variance, kl_gradient_bias, objectives, "
            "rejection.",
        ),
    ) -> None:
        """Reproduce the seeds' claims (IS collapse, CTPO variance, KL gradient bias) and measure one property per
        policy objective and what each IS rejection rule rejects, as figures and numbers."""
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
        from rich.table import Table

        from nemo_is_plugin.apps.cli.paths import check_paths
        from nemo_is_plugin.apps.evidence.runner import EXPERIMENTS, JSON_NAME, run_evidence, step_count

        console = Console()
        names = list(only) if only else list(EXPERIMENTS)
        unknown = [n for n in names if n not in EXPERIMENTS]
        if unknown:
            console.print(f"[red]unknown experiment(s) {unknown}; choose from {list(EXPERIMENTS)}[/red]")
            raise typer.Exit(_EXIT_BAD_INPUT)
        check_paths("evidence", [(output_dir, "--output-dir", "output_dir")])

        columns = (
            TextColumn("{task.description}"),
            BarColumn(),
            TextColumn("{task.completed}/{task.total}"),
            TimeElapsedColumn(),
        )
        with Progress(*columns, console=console, transient=True) as bar:
            task = bar.add_task("evidence", total=step_count(names))

            def advance(message: str) -> None:
                bar.update(task, advance=1, description=message)

            results = run_evidence(output_dir, quick=quick, seed=seed, only=names, progress=advance)

        _print_headline(console, results["headline"], Table)
        for path in results["files"]:
            console.print(f"wrote {path}")
        console.print(f"wrote {Path(output_dir) / JSON_NAME}")


def _print_headline(console, head: dict, table_cls) -> None:
    """One small table per experiment with the numbers docs/evidence.md quotes."""
    if "is_collapse" in head:
        h = head["is_collapse"]
        t = table_cls(title="IS collapse at 9k tokens (seed 002)")
        t.add_column("quantity")
        t.add_column("value", justify="right")
        t.add_row(
            "seed-fit mismatch: shift / spread per token", f"{h['seed_fit_shift']:+.3g} / {h['seed_fit_spread']:.3g}"
        )
        t.add_row("seed fit, exp(sum) mean (MC)", f"{h['seed_fit_mc_mean_9k']:.3f} +- {h['seed_fit_mc_mean_se']:.3f}")
        t.add_row("seed fit, exp(sum) std (MC)", f"{h['seed_fit_mc_std_9k']:.3f} +- {h['seed_fit_mc_std_se']:.3f}")
        t.add_row(
            "unbiased 2%: exp(sum) median / ESS",
            f"{h['unbiased2_sequence_median_9k']:.3f} / {h['unbiased2_sequence_ess_9k']:.3f}",
        )
        lo, hi = h["unbiased2_sequence_mean_p5_p95_9k"]
        t.add_row("unbiased 2%: exp(mean) 5th-95th pct", f"{lo:.4f} - {hi:.4f}")
        t.add_row(
            "2% shift: exp(sum) / exp(mean) mean",
            f"{h['shift2_sequence_mean_9k']:.2g} / {h['shift2_sequence_mean_level_9k']:.4f}",
        )
        console.print(t)
    if "ctpo_variance" in head:
        t = table_cls(title="CTPO: full-sequence / cumulative variance at t = 1 (seed 004)")
        for col in ("d", "H", "(1+d)^(H-1)", "E|Y|^2/E|X|^2", "se emp/exact", "Var ratio", "max|z| mean"):
            t.add_column(col, justify="right")
        for r in head["ctpo_variance"]:
            t.add_row(
                f"{r['chi2']:g}",
                str(r["horizon"]),
                f"{r['predicted_ratio_t1']:.3f}",
                f"{r['measured_second_moment_ratio_t1']:.3f}",
                f"{r['ratio_se_t1']:.3f}/{r['ratio_exact_se_t1']:.3f}",
                f"{r['measured_variance_ratio_t1']:.3f}",
                f"{r['max_abs_z_cumulative_mean']:.2f}",
            )
        console.print(t)
    if "kl_gradient_bias" in head:
        t = table_cls(title="KL gradient vs exact grad KL(pi || ref) (seed 003)")
        for col in ("variant", "max |z|", "p-value", "exact bias norm"):
            t.add_column(col, justify="right")
        for name, r in head["kl_gradient_bias"].items():
            t.add_row(name, f"{r['max_abs_z']:.1f}", f"{r['p_value']:.2g}", f"{r['exact_bias_norm']:.4f}")
        console.print(t)
    if "objectives" in head:
        title = "Policy objectives on synthetic batches (logit drift s from pi_old)"
        console.print(_property_table(table_cls, title, "objective", head["objectives"]))
    if "rejection" in head:
        title = "IS rejection rules on synthetic batches (rollout mismatch m between pi_prev and mu)"
        console.print(_property_table(table_cls, title, "rule", head["rejection"]))


def _property_table(table_cls, title: str, kind: str, properties: dict):
    """One row per measured property of each objective or rule (``kind``); a None value was not reached."""
    t = table_cls(title=title)
    for col, justify in ((kind, "left"), ("measured property", "left"), ("value", "right")):
        t.add_column(col, justify=justify)
    for name, props in properties.items():
        for i, (prop, value) in enumerate(props.items()):
            t.add_row(name if i == 0 else "", prop, "not reached" if value is None else f"{value:.3g}")
    return t
