"""What the ``nemo-is bench`` commands (the head paths, ``--host-heads``, ``--score-centering-head``) share: the
``--model`` selection and the targets' lines."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any


def selected_shapes(quick: bool, models: list[str] | None) -> tuple | None:
    """The head shapes named by ``--model`` (None: the run's default set); an unknown name is a ValueError naming the
    choices (the quick set under ``--quick``)."""
    from nemo_is_plugin.apps.bench.shapes import MODEL_SHAPES, QUICK_SHAPES

    known = {s.name: s for s in (QUICK_SHAPES if quick else MODEL_SHAPES)}
    if missing := [m for m in models or () if m not in known]:
        raise ValueError(f"unknown model(s) {missing}; choose from {list(known)}")
    return tuple(known[m] for m in models) if models else None


def print_targets(console: Any, targets: Iterable[Mapping[str, Any]]) -> None:
    """One line per target: met / not met, the target in words, the measured value."""
    from rich.markup import escape

    for t in targets:
        mark = "[green]met[/green]" if t["ok"] else "[red]not met[/red]"
        console.print(f"{mark}  {escape(t['target'])}: {t['value']:.3g}")
