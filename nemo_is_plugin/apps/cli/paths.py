"""The commands' file and folder options, checked before any work starts (before Ray, a benchmark or a sweep).

A path a command cannot use -- an output folder that is a file, an output file that is a folder, a parent that is a
file or not writable, an input that is missing -- is refused with one line naming the option and exit status 2, never
a traceback half-way through the run. Every command checks its paths here (:func:`check_paths`), so the rules and the
wording are the same everywhere.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Literal, NoReturn

import typer

EXIT_BAD_INPUT = 2
PathKind = Literal["output_dir", "output_file", "input_dir", "input_file"]


class PathError(ValueError):
    """A path option the command cannot use; the message names the option, the path and what to give instead."""


def _writable_ancestor(path: Path, option: str) -> None:
    """The nearest existing ancestor of ``path`` must be a writable folder (the command creates the rest)."""
    for parent in path.absolute().parents:
        if parent.exists():
            if not parent.is_dir():
                raise PathError(f"{option} {path}: {parent} is a file, not a folder")
            if not os.access(parent, os.W_OK):
                raise PathError(f"{option} {path}: cannot write in {parent}")
            return


def check_path(path: Path | str | None, option: str, kind: PathKind) -> None:
    """Raise :class:`PathError` if ``path`` cannot serve as ``kind``; None (an unset option) passes.

    - ``output_dir``: a folder, or nothing yet (created with its parents);
    - ``output_file``: a file (replaced) or nothing yet, never a folder;
    - ``input_dir`` / ``input_file``: must exist as a folder / a file.
    """
    if path is None:
        return
    path = Path(path)
    if kind == "input_dir":
        if not path.is_dir():
            raise PathError(f"{option} {path}: " + ("not a folder" if path.exists() else "no such folder"))
        return
    if kind == "input_file":
        if not path.is_file():
            raise PathError(f"{option} {path}: " + ("a folder, not a file" if path.is_dir() else "no such file"))
        return
    if kind == "output_dir" and path.exists() and not path.is_dir():
        raise PathError(f"{option} {path} is a file; give a folder (it is created if missing)")
    if kind == "output_file" and path.is_dir():
        raise PathError(f"{option} {path} is a folder; give a file path")
    if path.exists() and not os.access(path, os.W_OK):
        raise PathError(f"{option} {path}: not writable")
    if not path.exists():
        _writable_ancestor(path, option)


def check_paths(command: str, checks: Iterable[tuple[Path | str | None, str, PathKind]]) -> None:
    """Check every ``(path, option, kind)``; the first unusable one ends the command: :func:`refuse`."""
    try:
        for path, option, kind in checks:
            check_path(path, option, kind)
    except PathError as exc:
        refuse(command, str(exc))


def refuse(command: str, message: str) -> NoReturn:
    """One line on stderr, ``nemo-is <command>: <message>``, and exit status 2."""
    typer.echo(f"nemo-is {command}: {message}", err=True)
    raise typer.Exit(code=EXIT_BAD_INPUT)


__all__ = ["EXIT_BAD_INPUT", "PathError", "check_path", "check_paths", "refuse"]
