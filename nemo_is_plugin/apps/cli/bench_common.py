"""What the ``nemo-is bench`` commands (the head paths, ``--model-step``, ``--host-heads``, ``--score-centering-head``)
share: the options every mode takes, the ``--model`` selection, a measurement with its progress bar, and the lines
printed around a table."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import typer

C = TypeVar("C")


@dataclass(frozen=True)
class BenchRun:
    """The options of every bench mode: where it runs (``device``, ``dtype``), how much (``quick``, ``tokens``,
    ``repeats``), where its JSON goes (``out``) and the earlier runs' JSON files to render instead (``from_json``: the
    head paths merge several, the other modes read the first)."""

    device: str
    dtype: str | None
    quick: bool
    tokens: int | None
    repeats: int | None
    out: Path
    from_json: tuple[Path, ...]

    def for_device_options(self) -> dict[str, Any]:
        """The options a mode's ``Config.for_device`` takes from these (a None leaves the mode's default)."""
        return dict(quick=self.quick, tokens=self.tokens, repeats=self.repeats, dtype=self.dtype)

    def saved_or_measured(
        self,
        console: Any,
        configure: Callable[[], C],
        count_steps: Callable[[C], int],
        measure: Callable[[C, Callable[[str], None]], dict],
    ) -> dict:
        """The results of the first ``from_json``, or measured: ``configure()`` builds the mode's config once the
        device is resolved (a ValueError is a usage error: one line, exit 2), ``count_steps(cfg)`` sizes the progress
        bar and ``measure(cfg, progress)`` runs."""
        from nemo_is_plugin.apps.bench.device import BenchDevice
        from nemo_is_plugin.apps.bench.progress import progress_bar

        if self.from_json:
            return json.loads(self.from_json[0].read_text())
        try:
            BenchDevice.resolve(self.device, self.dtype)  # a usage error (no CUDA here, unknown dtype) before the run
            cfg = configure()
        except ValueError as exc:
            raise usage_error(console, exc) from exc
        with progress_bar(console, count_steps(cfg)) as progress:
            return measure(cfg, progress)


def usage_error(console: Any, exc: Exception) -> typer.Exit:
    """Print ``exc`` as a one-line error; the exit (status 2) to raise."""
    from rich.markup import escape

    console.print(f"[red]error:[/red] {escape(str(exc))}")
    return typer.Exit(code=2)


def selected_shapes(quick: bool, models: list[str] | None) -> tuple | None:
    """The head shapes named by ``--model`` (None: the run's default set); an unknown name is a ValueError naming the
    choices (the quick set under ``--quick``)."""
    from nemo_is_plugin.apps.bench.shapes import MODEL_SHAPES, QUICK_SHAPES

    known = {s.name: s for s in (QUICK_SHAPES if quick else MODEL_SHAPES)}
    if missing := [m for m in models or () if m not in known]:
        raise ValueError(f"unknown model(s) {missing}; choose from {list(known)}")
    return tuple(known[m] for m in models) if models else None


def print_note(console: Any, note: str | None) -> None:
    """A note under the table (nothing for None)."""
    from rich.markup import escape

    if note:
        console.print(f"[bold yellow]note:[/bold yellow] {escape(note)}")


def print_targets(console: Any, targets: Iterable[Mapping[str, Any]]) -> None:
    """One line per target: met / not met, the target in words, the measured value."""
    from rich.markup import escape

    for t in targets:
        mark = "[green]met[/green]" if t["ok"] else "[red]not met[/red]"
        console.print(f"{mark}  {escape(t['target'])}: {t['value']:.3g}")


def print_written(console: Any, paths: Iterable[Path]) -> None:
    console.print("wrote " + ", ".join(str(p) for p in paths))
