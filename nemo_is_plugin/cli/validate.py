"""``nemo-is validate``: load a recipe, validate it, and run the loss once on a synthetic batch."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer


def validate(
    recipe: Path = typer.Argument(..., help="YAML recipe: a loss_fn section or a host's whole master config."),
    override: Optional[List[str]] = typer.Option(None, "--override", "-o", help="Dotted override, e.g. loss_fn.x=1"),
    section: str = typer.Option("loss_fn", help="Dotted path of the loss section in the YAML."),
    batch_size: int = typer.Option(8, help="Sequences in the synthetic batch."),
    seq_len: int = typer.Option(256, help="Tokens per sequence in the synthetic batch."),
    mismatch_std: float = typer.Option(0.02, help="Std of the per-token rollout/training log-prob mismatch."),
) -> None:
    """Validate RECIPE and print its loss and metrics on a synthetic batch with a rollout/training mismatch."""
    from rich.console import Console
    from rich.table import Table

    from nemo_is_plugin import build_loss_fn, finalize_metrics
    from nemo_is_plugin.config import ConfigError
    from nemo_is_plugin.recipes import load_loss_config
    from nemo_is_plugin.synthetic_batch import synthetic_batch

    console = Console()
    try:
        config = load_loss_config(recipe, overrides=override or (), section=section)
    except (ConfigError, ValueError) as exc:
        console.print(f"[red]invalid recipe {recipe}:[/red] {exc}")
        raise typer.Exit(code=2) from exc
    changed = config.model_dump(exclude_defaults=True)
    console.print(f"[green]valid[/green] {recipe}: " + (", ".join(f"{k}={v}" for k, v in changed.items()) or "defaults"))

    logprobs, data = synthetic_batch(batch_size, seq_len, mismatch_std=mismatch_std)
    logprobs.requires_grad_(True)
    valid_toks = (data["token_mask"][:, 1:] * data["sample_mask"][:, None]).sum()
    loss_fn = build_loss_fn(config)
    loss, metrics = loss_fn(
        next_token_logprobs=logprobs, data=data, global_valid_seqs=data["sample_mask"].sum(),
        global_valid_toks=valid_toks,
    )
    loss.backward()
    table = Table(title=f"loss {loss.item():.6g}, |grad| {logprobs.grad.norm().item():.4g}")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for name, value in sorted(finalize_metrics(metrics).items()):
        table.add_row(name, f"{value:.6g}")
    console.print(table)


def register(app: typer.Typer) -> None:
    app.command("validate")(validate)
