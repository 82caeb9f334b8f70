"""A :class:`~nemo_is_plugin.apps.compat.compare.CompatReport` as rich tables and as JSON."""

from __future__ import annotations

import math
from dataclasses import asdict
from typing import Any

from nemo_is_plugin.apps.compat.compare import AGREES, CHANGED, DELIBERATE, DIFFERS, PLUGIN_ONLY, CompatReport, Finding

_LISTED = 8
_STYLE = {AGREES: "green", DIFFERS: "bold red", DELIBERATE: "yellow", CHANGED: "cyan", PLUGIN_ONLY: "dim"}


def _number(x: float) -> str:
    return "inf" if math.isinf(x) else f"{x:.3g}"


def verdict(report: CompatReport) -> str:
    """One line: what the exit status says."""
    failures = report.failures
    if failures:
        names = ", ".join(f.output for f in failures)
        return f"DIFFERS: the plugin does not reproduce {report.host} on {len(failures)} output(s): {names}"
    documented = [f.output for f in report.parity if f.status == DELIBERATE]
    extra = f" except documented differences ({', '.join(documented)})" if documented else ""
    changed = f"; the plugin keys change {len(report.changes)} output(s)" if report.changes else ""
    return f"AGREES: the plugin reproduces {report.host} on every output it reports{extra}{changed}"


def _values(f: Finding) -> str:
    """``host -> plugin`` at the finding's worst batch; the gradient's values are the norms of its finite entries."""
    if f.host_value is None or f.plugin_value is None:
        return ""
    norm = "|g|: " if f.output == "gradient" else ""
    return f"{norm}{f.host_value:.4g} -> {f.plugin_value:.4g}"


def _table(title: str, findings: list[Finding], values: bool = False) -> Any:
    """The findings as a table; ``values``: the host's and the plugin's value at the worst batch instead of the
    relative difference."""
    from rich.table import Table
    from rich.text import Text

    table = Table(title=title, title_justify="left")
    table.add_column("output", overflow="fold", min_width=20)
    table.add_column("status")
    if values:
        table.add_column("host -> plugin", justify="right")
    table.add_column("max |diff|", justify="right")
    if not values:
        table.add_column("max rel", justify="right")
    table.add_column("worst batch", overflow="fold", max_width=16 if values else None)
    table.add_column("why / note", overflow="fold", ratio=1)
    for f in findings:
        plain = f.status in (AGREES, PLUGIN_ONLY)
        both = [_values(f)] if values else []
        table.add_row(
            Text(f.output),
            Text(f.status, style=_STYLE[f.status]),
            *both,
            _number(f.abs_diff),
            *([] if values else [_number(f.rel_diff)]),
            Text("" if plain and not f.abs_diff else f.batch),
            Text("; ".join(f.notes)),
        )
    return table


def print_report(console: Any, report: CompatReport) -> None:
    shown = [f for f in report.parity if f.status != PLUGIN_ONLY]
    extra = [f.output.removeprefix("metric ") for f in report.parity if f.status == PLUGIN_ONLY]
    console.print(
        f"[bold]nemo-is compat[/bold] {report.config} against the installed {report.host}, "
        f"{len(report.batches)} batches: {', '.join(report.batches)}",
        highlight=False,
    )
    console.print(f"tolerances: {report.tolerances.describe()}", highlight=False)
    keys = ", ".join(report.plugin_keys) or "none"
    console.print(_table(f"the host's part of the config: host vs plugin (plugin keys left out: {keys})", shown))
    if extra:
        names = ", ".join(extra[:_LISTED]) + (", ... (--json lists all)" if len(extra) > _LISTED else "")
        console.print(f"{len(extra)} metrics only the plugin reports (not compared): {names}", highlight=False)
    if report.plugin_keys:
        if report.changes:
            title = "with the plugin keys: outputs they change (not failures), host and plugin at the worst batch"
            console.print(_table(title, report.changes, values=True))
        else:
            console.print("with the plugin keys: no output the host reports changes", highlight=False)
        if report.unchanged:
            console.print(f"unchanged with the plugin keys: {', '.join(report.unchanged)}", highlight=False)
    style = "red" if report.failures else "green"
    console.print(f"[{style}]{verdict(report)}[/{style}]", highlight=False)


def _finite(x: Any) -> Any:
    return x if not isinstance(x, float) or math.isfinite(x) else str(x)


def report_json(report: CompatReport) -> dict[str, Any]:
    def finding(f: Finding) -> dict[str, Any]:
        return {k: _finite(v) for k, v in asdict(f).items()}

    return {
        "host": report.host,
        "config": report.config,
        "agrees": report.agrees,
        "verdict": verdict(report),
        "strict": report.strict,
        "host_keys": report.host_keys,
        "plugin_keys": report.plugin_keys,
        "batches": report.batches,
        "tolerances": asdict(report.tolerances),
        "parity": [finding(f) for f in report.parity],
        "changes": [finding(f) for f in report.changes],
        "unchanged": report.unchanged,
    }


__all__ = ["print_report", "report_json", "verdict"]
