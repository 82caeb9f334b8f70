"""Every import path the documentation names exists: README.md, docs/*.md, configs/ and pyproject.toml.

Three forms are extracted from the text: Python import statements (``from nemo_is_plugin.x import a, b`` and
``import nemo_is_plugin.x``, parenthesised lists included), dotted references (``nemo_is_plugin.x.y``, ``module:attr``
as entry points write them, ``python -m nemo_is_plugin.apps.cli.main``) and file paths (``nemo_is_plugin/x/y.py``). A
dotted reference is imported as the longest importable module prefix, the rest read as attributes.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

from nemo_is_plugin.loss.objectives import ENTRY_POINT_GROUP as OBJECTIVE_ENTRY_POINT_GROUP
from nemo_is_plugin.loss.registry import ENTRY_POINT_GROUP

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted(
    [ROOT / "README.md", ROOT / "pyproject.toml", *(ROOT / "docs").glob("*.md"), *(ROOT / "configs").rglob("*.yaml")]
)
# Names that look like paths but are not: the loss and objective entry-point groups are names in package metadata.
NOT_PATHS = {ENTRY_POINT_GROUP, OBJECTIVE_ENTRY_POINT_GROUP}

_FROM_IMPORT = re.compile(r"from\s+(nemo_is_plugin[\w.]*)\s+import\s+(\([^)]*\)|[\w ,]+)")
_IMPORT = re.compile(r"^\s*import\s+(nemo_is_plugin[\w.]*)", re.M)
_DOTTED = re.compile(r"(?<![\w/.])(nemo_is_plugin(?:\.\w+)*)(?::([\w.]+))?")
_FILE = re.compile(r"(?<![\w/.])nemo_is_plugin/[\w./]*")


def extract(text: str) -> tuple[set[str], set[str]]:
    """(dotted names, file paths) named by ``text``; ``from m import a`` gives ``m.a``."""
    dotted: set[str] = set()
    for module, names in _FROM_IMPORT.findall(text):
        for name in names.strip("()").replace("\n", " ").split(","):
            name = name.split(" as ")[0].strip()
            if name:
                dotted.add(f"{module}.{name}")
    dotted.update(_IMPORT.findall(text))
    for module, attr in _DOTTED.findall(text):
        module = module.rstrip(".")
        if module not in NOT_PATHS:
            dotted.add(f"{module}.{attr}" if attr else module)
    files = {match.rstrip(".") for match in _FILE.findall(text)}
    return dotted, files


def resolve(dotted: str) -> object:
    """The object ``dotted`` names: its longest importable module prefix, then attributes (ImportError /
    AttributeError when it names nothing)."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError as exc:
            if exc.name is None or not ".".join(parts[:cut]).startswith(exc.name):
                raise  # the module exists but one of its own imports failed
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(f"no module in {dotted!r}")


def _named() -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    dotted: dict[str, list[str]] = {}
    files: dict[str, list[str]] = {}
    for source in SOURCES:
        names, paths = extract(source.read_text())
        where = str(source.relative_to(ROOT))
        for name in names:
            dotted.setdefault(name, []).append(where)
        for path in paths:
            files.setdefault(path, []).append(where)
    return dotted, files


DOTTED, FILES = _named()


@pytest.mark.parametrize("dotted", sorted(DOTTED))
def test_documented_import_path_resolves(dotted):
    try:
        resolve(dotted)
    except (ImportError, AttributeError) as exc:
        pytest.fail(f"{dotted} (named in {', '.join(DOTTED[dotted])}) does not resolve: {exc}")


@pytest.mark.parametrize("path", sorted(FILES))
def test_documented_file_exists(path):
    assert (ROOT / path).exists(), f"{path} (named in {', '.join(FILES[path])}) does not exist"


def test_the_public_entry_points_are_documented():
    """The paths users start from are among those checked (so the extraction finds them at all)."""
    for name in (
        "nemo_is_plugin.build_loss_fn",
        "nemo_is_plugin.adapters.nemo_rl.NeMoRLLossFn",
        "nemo_is_plugin.loss.ClippedPGLoss",
        "nemo_is_plugin.apps.cli.main.app",
        "nemo_is_plugin.registry.build_loss_fn",
        "nemo_is_plugin.recipes.load_loss_spec",
        "nemo_is_plugin.adapters.verl.plugin",
    ):
        assert name in DOTTED, name


def test_a_path_that_does_not_exist_is_caught():
    text = (
        "```python\nfrom nemo_is_plugin.loss import ClippedPGLoss, NoSuchLoss\n```\n"
        "see `nemo_is_plugin.no_such_module.f` and `nemo_is_plugin/no_such_file.py`"
    )
    dotted, files = extract(text)
    assert {
        "nemo_is_plugin.loss.ClippedPGLoss",
        "nemo_is_plugin.loss.NoSuchLoss",
        "nemo_is_plugin.no_such_module.f",
    } <= dotted
    assert files == {"nemo_is_plugin/no_such_file.py"}
    resolve("nemo_is_plugin.loss.ClippedPGLoss")
    with pytest.raises(AttributeError):
        resolve("nemo_is_plugin.loss.NoSuchLoss")
    with pytest.raises(AttributeError):
        resolve("nemo_is_plugin.no_such_module.f")
