"""``nemo-is compat``: the installed host's loss against the plugin's, on the user's own config (docs/compat.md).

Exit status: 0 when every output the host reports agrees (documented deliberate differences allowed, unless
``--strict``); 1 when one differs; 2 when nothing could be compared (the host does not import, the config or the dump
cannot be read), with one line saying why and what to install or fix.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import NoReturn

import typer

from nemo_is_plugin.apps.cli.paths import check_paths, refuse

_EXIT_DIFFERS = 1  # cannot compare: 2 (nemo_is_plugin.apps.cli.paths.refuse)


def compat(
    config: Path = typer.Argument(..., help="The trainer's own config: NeMo-RL's master YAML or verl's Hydra YAML."),
    host: str = typer.Option("nemo-rl", "--host", help="The installed host to compare against: nemo-rl or verl."),
    override: list[str] | None = typer.Option(
        None, "--override", "-o", help="Hydra-style override of the config, e.g. loss_fn.ratio_clip_max=0.28"
    ),
    batches: int = typer.Option(4, "--batches", help="Synthetic batches (4 cover every kind of edge input)."),
    rollouts: Path | None = typer.Option(
        None, "--rollouts", help="A rollout dump (nemo-is diagnose's format): also compare on its batches."
    ),
    json_out: Path | None = typer.Option(None, "--json", help="Also write the report as JSON to this file."),
    strict: bool = typer.Option(False, "--strict", help="Documented deliberate differences fail too."),
    seed: int = typer.Option(0, "--seed", help="Seed of the synthetic batches and of the dump's current policy."),
) -> None:
    """Compare the installed host's loss with the plugin's on CONFIG: loss, gradient and every host metric."""
    from rich.console import Console

    from nemo_is_plugin.apps.compat import HOSTS, load_host
    from nemo_is_plugin.apps.compat.batches import dump_batches, synthetic_batches
    from nemo_is_plugin.apps.compat.compare import run_compat
    from nemo_is_plugin.apps.compat.nemo_rl_host import HostUnavailableError
    from nemo_is_plugin.apps.compat.render import print_report, report_json
    from nemo_is_plugin.apps.diagnose.dump import DumpError
    from nemo_is_plugin.config import ConfigError

    console = Console(width=max(Console().width, 140))  # the table's notes stay readable in a log file
    if host not in HOSTS:
        _refuse(f"--host {host!r}: one of {', '.join(HOSTS)}")
    check_paths("compat", [(config, "CONFIG", "input_file"), (json_out, "--json", "output_file")])
    try:
        compared = synthetic_batches(batches, seed)
        if rollouts is not None:
            compared += dump_batches(rollouts, max(batches, 1), seed)
        target = load_host(host, config, override or ())
    except HostUnavailableError as exc:
        _refuse(str(exc))
    except DumpError as exc:
        _refuse(f"--rollouts: {exc}")
    except (ConfigError, ValueError) as exc:  # the config's path once: most messages start with it
        _refuse(f"cannot compare: {exc}" if str(config) in str(exc) else f"cannot compare {config}: {exc}")
    with warnings.catch_warnings():  # the batches' edge inputs are deliberate: the plugin's input warnings are noise
        warnings.simplefilter("ignore")
        report = run_compat(target, compared, str(config), strict=strict)
    print_report(console, report)
    if json_out is not None:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(report_json(report), indent=1, allow_nan=False, default=str) + "\n")
    if not report.agrees:
        raise typer.Exit(code=_EXIT_DIFFERS)


def _refuse(message: str) -> NoReturn:
    refuse("compat", message)


def register(app: typer.Typer) -> None:
    app.command("compat")(compat)
