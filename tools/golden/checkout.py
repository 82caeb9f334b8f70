"""Importing a golden suite's reference from a checkout of its host: the checkout first on ``sys.path`` (so the code
at the suite's recorded commit runs, not a copy installed in the environment), stubs for the modules the reference
imports but its loss code never runs, and the checkout's commit (``common.run`` prints it next to the recorded one)."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import subprocess
import sys
import types
from collections.abc import Iterable
from pathlib import Path
from typing import Any


class _StubAttribute(type):
    """A class standing for any attribute of a stubbed module: usable as a base class, a decorator, a type hint, and
    any attribute of it is another stub (``transformers.AutoConfig.from_pretrained``)."""

    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        attribute = _stub_class(name)
        setattr(cls, name, attribute)  # the same object on every access, as a real attribute would be
        return attribute

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        # Used as a bare decorator (``@ray.remote``), hand the decorated object back unchanged.
        if len(args) == 1 and not kwargs and (callable(args[0]) or isinstance(args[0], type)):
            return args[0]
        return super().__call__(*args, **kwargs)


def _stub_class(name: str) -> _StubAttribute:
    return _StubAttribute(name, (), {"__init__": lambda self, *args, **kwargs: None})


class _StubModule(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        attribute = _stub_class(name)
        setattr(self, name, attribute)
        return attribute


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Resolves the named top-level packages (and any submodule of them) to empty stub modules."""

    def __init__(self, roots: Iterable[str]) -> None:
        self.roots = frozenset(roots)

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname.split(".")[0] not in self.roots:
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _StubModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


def install_stubs(always: Iterable[str] = (), if_missing: Iterable[str] = ()) -> None:
    """Stub modules the reference imports at module level but its loss code never calls.

    ``always``: modules (or submodules such as ``torch.utils.tensorboard``) replaced even when installed, because the
    installed version cannot be imported by the reference (an API it names no longer exists) or is irrelevant and slow.
    ``if_missing``: top-level packages stubbed only when they are not installed (the finder is consulted last).
    The stubs are this project's code; the reference's own code runs unchanged.
    """
    always = list(always)
    top = {name for name in always if "." not in name}
    for name in always:
        if "." in name:  # a submodule of a real package: put the stub straight into sys.modules
            module = _StubModule(name)
            module.__path__ = []
            sys.modules[name] = module
    if top:
        for name in list(sys.modules):
            if name.split(".")[0] in top:
                del sys.modules[name]
        sys.meta_path.insert(0, _StubFinder(top))
    if_missing = set(if_missing)
    if if_missing:
        sys.meta_path.append(_StubFinder(if_missing))


def use_checkout(repo: Path, package: str) -> types.ModuleType:
    """Import ``package`` from the checkout at ``repo`` (first on sys.path; any copy imported before is dropped) and
    check that it really came from there."""
    repo = repo.resolve()
    if not (repo / package).is_dir():
        raise SystemExit(f"--repo {repo}: no '{package}/' package there; pass a checkout of the reference repository")
    for name in list(sys.modules):
        if name == package or name.startswith(package + "."):
            del sys.modules[name]
    sys.path.insert(0, str(repo))
    module = __import__(package)
    origin = Path(module.__file__ or "").resolve()
    if repo not in origin.parents:
        raise SystemExit(f"'{package}' was imported from {origin}, not from the checkout {repo}")
    return module


def checkout_commit(repo: Path) -> str | None:
    """HEAD of the git checkout at ``repo``; None for a plain source tree (e.g. a ``git archive``)."""
    try:
        done = subprocess.run(
            ["git", "-C", str(repo), "rev-parse", "--show-toplevel", "HEAD"], capture_output=True, text=True, check=True
        )
    except (OSError, subprocess.CalledProcessError):
        return None
    top, head = done.stdout.split()
    return head if Path(top).resolve() == repo.resolve() else None  # not a checkout nested in another repository
