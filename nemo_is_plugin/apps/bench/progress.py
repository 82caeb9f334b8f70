"""A rich progress bar driven by ``progress(label)`` calls: each call finishes the previous step and names the next.

On a terminal it is a live bar; piped to a log it prints one line per step instead.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator


@contextlib.contextmanager
def progress_bar(console, total: int) -> Iterator[Callable[[str], None]]:
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    ) as bar:
        task = bar.add_task("starting", total=total)
        state = {"started": False}

        def progress(label: str) -> None:
            if state["started"]:
                bar.advance(task)
            state["started"] = True
            bar.update(task, description=label)
            if not console.is_terminal:  # a log file gets one line per step instead of a live bar
                console.log(label)

        yield progress
        bar.advance(task)


__all__ = ["progress_bar"]
