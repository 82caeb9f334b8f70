"""``nemo-is validate``: load a recipe, validate it, and run the loss once on a synthetic batch.

Exit status 2 for every bad input (unreadable or invalid recipe, an override that matches nothing, a key no setting
reads unless ``--allow-unknown-keys``, a bad option), with the message on the terminal (or as JSON with ``--json``);
nothing is written anywhere. A checking command fails on a misspelled key; the loss itself only warns at run time,
because NeMo-RL's own config accepts extra keys.
"""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path
from typing import Any, NoReturn

import typer
from rich.markup import escape

_EXIT_BAD_INPUT = 2


def validate(
    recipe: Path = typer.Argument(..., help="YAML recipe: a loss_fn section or a host's whole master config."),
    override: list[str] | None = typer.Option(None, "--override", "-o", help="Dotted override, e.g. loss_fn.x=1"),
    section: str = typer.Option("loss_fn", help="Dotted path of the loss section in the YAML."),
    batch_size: int = typer.Option(8, help="Sequences in the synthetic batch (>= 1)."),
    seq_len: int = typer.Option(
        256, help="Tokens per sequence in the synthetic batch (>= 6: a 4-token prompt + response)."
    ),
    mismatch_std: float = typer.Option(0.02, help="Std of the per-token rollout/training log-prob mismatch (>= 0)."),
    show_effective: bool = typer.Option(
        False,
        "--show-effective",
        help="Also print every effective setting (resolved "
        "ratio level, clip, IS level, truncation, KL, aggregation) and every key.",
    ),
    as_json: bool = typer.Option(
        False, "--json", help="Print one JSON object (verdict, settings, loss, metrics) only."
    ),
    allow_unknown_keys: bool = typer.Option(
        False,
        "--allow-unknown-keys",
        help="Accept keys no loss setting reads (listed, then ignored, as NeMo-RL ignores them) instead of failing.",
    ),
) -> None:
    """Validate RECIPE and print its loss and metrics on a synthetic batch with a rollout/training mismatch."""
    from rich.console import Console

    from nemo_is_plugin.adapters.nemo_rl.loss_fn import check_generation_for_score_centering
    from nemo_is_plugin.adapters.recipes import load_loss_spec, load_yaml
    from nemo_is_plugin.apps.cli.synthetic_batch import synthetic_batch
    from nemo_is_plugin.config import ConfigError, UnknownConfigKeyWarning

    console = Console()
    try:
        batch = synthetic_batch(batch_size, seq_len, mismatch_std=mismatch_std)  # checks the options first
    except ValueError as exc:
        _fail(console, as_json, recipe, _option_names(str(exc)), "invalid option:")
    try:
        with warnings.catch_warnings():  # unknown keys are this command's verdict below, not a Python warning
            warnings.simplefilter("ignore", UnknownConfigKeyWarning)
            spec = load_loss_spec(recipe, overrides=override or (), section=section)
        if spec.config.score_centering:  # a master config's sampling settings; a head in the synthetic batch
            check_generation_for_score_centering(load_yaml(recipe, override or (), section), spec.config.model_dump())
            batch = synthetic_batch(
                batch_size, seq_len, mismatch_std=mismatch_std, head_k=spec.config.score_centering_top_k or 8
            )
    except (ConfigError, ValueError) as exc:
        message = str(exc)  # the recipe's path once: most messages start with it
        _fail(
            console,
            as_json,
            recipe,
            message,
            "invalid recipe:" if str(recipe) in message else f"invalid recipe {recipe}:",
        )
    ignored = _ignored_name(recipe, override or (), section)
    if ignored is not None:
        _fail(console, as_json, recipe, ignored, f"invalid recipe {recipe}:")
    unknown = _unknown_keys(spec, section)
    if unknown is not None and not allow_unknown_keys:
        _fail(
            console,
            as_json,
            recipe,
            f"{unknown}; NeMo-RL's loss would ignore them (--allow-unknown-keys accepts them)",
            f"invalid recipe {recipe}:",
        )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnknownConfigKeyWarning)
        loss, grad_norm, metrics = _run(spec, batch)
    if as_json:
        report = _json_report(recipe, section, spec, loss, grad_norm, metrics)
        print(json.dumps({**report, "ignored_keys": unknown}, indent=1, allow_nan=False))
        return
    if unknown is not None:
        console.print(f"[yellow]ignored[/yellow] {escape(unknown)}", highlight=False, soft_wrap=True)
    _print_report(console, recipe, section, spec, loss, grad_norm, metrics, show_effective)


def _unknown_keys(spec, section: str) -> str | None:
    """``unknown <section> key(s): 'x' (did you mean 'y'?)`` for the keys of the section no setting reads, or None."""
    from nemo_is_plugin.config.unknown_keys import unknown_keys_message
    from nemo_is_plugin.loss.config_model import ClippedPGLossConfig

    known = set(ClippedPGLossConfig.model_fields)
    unknown = [k for k in spec.given if k not in known]
    return unknown_keys_message(unknown, known, section) if unknown else None


def _ignored_name(recipe: Path, overrides, section: str) -> str | None:
    """NeMo-RL installed here, its ``ClippedPGLossFn`` not switched: the ``name`` the section gives would be ignored."""
    from nemo_is_plugin.adapters.nemo_rl.startup.loss_switch import ignored_name_message, plugin_name
    from nemo_is_plugin.adapters.recipes import load_yaml
    from nemo_is_plugin.loss.registry import NAME_KEY

    loss_section: Any = load_yaml(recipe, overrides, section)
    for part in section.split("."):
        loss_section = loss_section.get(part) if hasattr(loss_section, "get") else None
    name = plugin_name({NAME_KEY: loss_section.get(NAME_KEY)} if hasattr(loss_section, "get") else {})
    return None if name is None else ignored_name_message(name)


def _option_names(message: str) -> str:
    """synthetic_batch's argument names as the command's options."""
    for arg, opt in (("batch_size", "--batch-size"), ("seq_len", "--seq-len"), ("mismatch_std", "--mismatch-std")):
        message = message.replace(arg, opt)
    return message


def _fail(console, as_json: bool, recipe: Path, message: str, head: str) -> NoReturn:
    if as_json:
        print(json.dumps({"valid": False, "recipe": str(recipe), "error": message}, indent=1))
    else:  # escaped: pydantic's "[type=..., input_value=...]" is the bad value, not a markup tag
        console.print(f"[red]{escape(head)}[/red] {escape(message)}", highlight=False, soft_wrap=True)
    raise typer.Exit(code=_EXIT_BAD_INPUT)


def _run(spec, batch) -> tuple[float, float, dict[str, float]]:
    """The loss the recipe names, once on the synthetic batch: (loss, |d loss / d logprobs|, finalized metrics)."""
    from nemo_is_plugin import finalize_metrics
    from nemo_is_plugin.loss.registry import NAME_KEY, build_loss_fn

    logprobs, data = batch
    logprobs.requires_grad_(True)
    valid_toks = (data["token_mask"][:, 1:] * data["sample_mask"][:, None]).sum()
    loss_fn = build_loss_fn({**spec.config.model_dump(exclude_unset=True), NAME_KEY: spec.name})
    loss, metrics = loss_fn(
        next_token_logprobs=logprobs,
        data=data,
        global_valid_seqs=data["sample_mask"].sum(),
        global_valid_toks=valid_toks,
    )
    loss.backward()
    return loss.item(), logprobs.grad.norm().item(), finalize_metrics(metrics)


def _defaults_note(spec, section: str) -> str | None:
    if spec.given:
        return None
    where = "the file is empty" if spec.empty_source else f"the {section!r} section is empty"
    return f"{where}: every key takes its default (NeMo-RL's ClippedPGLoss defaults; --show-effective lists them)"


def _finite(x: Any) -> Any:
    return x if not isinstance(x, float) or math.isfinite(x) else None


def _json_report(recipe, section, spec, loss, grad_norm, metrics) -> dict[str, Any]:
    from nemo_is_plugin.loss.effective import effective_settings

    return {
        "valid": True,
        "recipe": str(recipe),
        "section": section,
        "name": spec.name,
        "defaults": _defaults_note(spec, section),
        "changed": spec.config.model_dump(exclude_defaults=True),
        "effective": effective_settings(spec.config),
        "config": spec.config.model_dump(),
        "loss": _finite(loss),
        "grad_norm": _finite(grad_norm),
        "metrics": {k: _finite(v) for k, v in sorted(metrics.items())},
    }


def _print_report(console, recipe, section, spec, loss, grad_norm, metrics, show_effective: bool) -> None:
    from rich.table import Table
    from rich.text import Text

    from nemo_is_plugin.loss.effective import effective_settings

    changed = spec.config.model_dump(exclude_defaults=True)
    head = f"[green]valid[/green] {escape(str(recipe))} (loss {spec.name})"
    note = _defaults_note(spec, section)
    if note is not None:
        console.print(f"{head}: {note}", highlight=False)
    elif not changed:
        console.print(f"{head}: every key it sets equals its default", highlight=False)
    else:
        console.print(f"{head}: " + escape(", ".join(f"{k}={v}" for k, v in changed.items())), highlight=False)
    if show_effective:
        table = Table(title="effective settings", title_justify="left")
        table.add_column("choice")
        table.add_column("effective value")
        for name, value in effective_settings(spec.config).items():
            table.add_row(name, Text(value))  # plain text: "sg[c]" is no markup tag
        console.print(table)
        keys = Table(title=f"every {section} key", title_justify="left")
        for col in ("key", "value", "source"):
            keys.add_column(col)
        for key, value in spec.config.model_dump().items():
            keys.add_row(key, Text(repr(value)), "set" if key in spec.given else "default")
        console.print(keys)
    table = Table(title=f"loss {loss:.6g}, |grad| {grad_norm:.4g} (synthetic batch)")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for name, value in sorted(metrics.items()):
        table.add_row(name, f"{value:.6g}")
    console.print(table)


def register(app: typer.Typer) -> None:
    app.command("validate")(validate)
