"""``nemo-is demo``: GRPO on a tiny Megatron MoE model (TP=2 over gloo) with a real rollout/training mismatch, on
Ray, comparing the IS settings of ``configs/demo``. Heavy imports happen inside the command."""

from __future__ import annotations

from pathlib import Path

import typer


def _build_config(
    output_dir: str,
    steps: int | None,
    response_length: int | None,
    configs: str | None,
    ray_address: str | None,
    backend: str,
    precision: str | None,
    seed: int,
    quick: bool,
    run_config: Path | None,
):
    from omegaconf import OmegaConf

    from nemo_is_plugin.apps.demo.settings import DemoConfig
    from nemo_is_plugin.apps.demo.settings import quick as quick_cfg

    data = OmegaConf.to_container(OmegaConf.load(run_config), resolve=True) if run_config else {}
    if not isinstance(data, dict):
        raise ValueError(
            f"--run-config {run_config}: expected a mapping of DemoConfig fields, got a {type(data).__name__}"
        )
    cfg = DemoConfig.model_validate(data)
    if quick:
        cfg = quick_cfg(cfg)
    upd = cfg.model_dump()
    upd.update(output_dir=output_dir, seed=seed, ray_address=ray_address)
    upd["rollout"]["backend"] = backend
    if precision:
        upd["rollout"]["precision"] = precision
    elif backend == "vllm" and upd["rollout"]["precision"] not in ("bf16", "fp8"):
        upd["rollout"]["precision"] = "bf16"
    if steps is not None:
        upd["short"]["steps"] = steps
    if response_length is not None:
        if response_length <= 0:
            upd["long"] = None
        else:
            upd["long"]["response_length"] = response_length
    if configs:
        upd["loss_settings"] = [c.strip() for c in configs.split(",") if c.strip()]
    return DemoConfig(**upd)


def register(app: typer.Typer) -> None:
    @app.command("demo")
    def demo(
        output_dir: str = typer.Option("runs/demo", help="Where metrics.jsonl/csv, rollouts.jsonl, comparison.png go."),
        steps: int | None = typer.Option(None, help="GRPO steps per setting on short responses (default 12)."),
        response_length: int | None = typer.Option(
            None, help="Length of the long-response phase (EOS ignored; default 1024; 0 skips the phase)."
        ),
        configs: str | None = typer.Option(
            None, help="Comma-separated loss settings: names in configs/demo or YAML paths (default: all four)."
        ),
        ray_address: str | None = typer.Option(None, help="Ray cluster address; default starts a local Ray."),
        backend: str = typer.Option("cpu", help="Rollout backend: cpu (embedded sampler) or vllm (GPU + vllm)."),
        precision: str | None = typer.Option(
            None, help="Rollout numerics for the cpu backend: fp32 | bf16 | fp8 | int4 (default fp8)."
        ),
        seed: int = typer.Option(0, help="Seed of model init, data and sampling."),
        quick: bool = typer.Option(
            False, "--quick", help="Short run for tests: 6 GRPO steps, one long batch per setting."
        ),
        run_config: Path | None = typer.Option(
            None, exists=True, dir_okay=False, help="YAML with DemoConfig overrides (model, warm_start, grpo, ...)."
        ),
        plot_only: bool = typer.Option(
            False, "--plot-only", help="Only redraw comparison.png from an existing output dir."
        ),
    ) -> None:
        """End-to-end GRPO with IS-corrected losses side by side; writes metrics, rollouts and a comparison plot."""
        from rich.console import Console

        from nemo_is_plugin.apps.cli.paths import check_paths, refuse

        # before Ray starts: --plot-only reads an earlier run's folder, a run writes one
        check_paths("demo", [(output_dir, "--output-dir", "input_dir" if plot_only else "output_dir")])
        if plot_only and not (Path(output_dir) / "metrics.jsonl").is_file():
            refuse("demo", f"--plot-only: {output_dir} holds no metrics.jsonl; give the --output-dir of a demo run")
        console = Console()
        if plot_only:
            from nemo_is_plugin.apps.demo.plot import plot_comparison

            console.print(f"wrote {plot_comparison(output_dir)}")
            return
        if backend not in ("cpu", "vllm"):
            raise typer.BadParameter("--backend must be cpu or vllm")
        try:
            cfg = _build_config(
                output_dir, steps, response_length, configs, ray_address, backend, precision, seed, quick, run_config
            )
            from nemo_is_plugin.apps.demo.settings import load_loss_settings

            settings = load_loss_settings(cfg.loss_settings)
        except (ValueError, FileNotFoundError) as exc:
            console.print(f"[red]demo configuration error:[/red] {exc}")
            raise typer.Exit(2) from None
        _run(cfg, settings, console)


def _run(cfg, settings, console) -> None:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    from nemo_is_plugin.apps.demo.loop import run_demo
    from nemo_is_plugin.apps.demo.plot import plot_comparison

    total = 1 + sum(p.steps for _, p in cfg.phases()) * len(settings)
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.fields[info]}"),
    )
    with Progress(*columns, console=console) as progress:
        bar = progress.add_task("starting Ray workers", total=total, info="")

        def hook(event: str, payload: dict) -> None:
            if event == "phase":
                progress.update(bar, description=payload["name"])
            elif event == "step":
                progress.advance(bar)
                if "config" in payload:
                    info = (
                        f"reward {payload['reward']:.2f}  IS w {payload.get('is_raw_weight_mean', float('nan')):.2f}"
                        f"  KL {payload.get('mismatch_kl_k3', float('nan')):.1e}"
                    )
                else:
                    info = payload.get("message", "")
                progress.update(bar, info=info)
            elif event == "info":
                progress.console.print(payload["message"])

        result = run_demo(cfg, settings, hook)
    png = plot_comparison(cfg.output_dir)
    table = Table(title=f"nemo-is demo ({result.seconds:.0f} s, warm-start reward {result.warm_start_reward:.3f})")
    for col in ("setting", "final reward", "long: IS w mean", "long: IS w ESS", "long: mismatch KL"):
        table.add_column(col)
    for name in settings:  # the numbers summary.json keeps under "headline" (what README.md quotes)
        h = result.headline["settings"].get(name, {})

        def fmt(key: str, h: dict = h) -> str:
            return f"{h[key]:.3g}" if h.get(key) is not None else "-"

        table.add_row(
            name,
            f"{result.final_reward.get(name, float('nan')):.3f}",
            fmt("long_is_weight_mean"),
            fmt("long_is_weight_ess"),
            fmt("long_mismatch_kl_k3"),
        )
    console.print(table)
    console.print(f"wrote {Path(cfg.output_dir) / 'metrics.jsonl'}, metrics.csv, rollouts.jsonl, summary.json, {png}")
