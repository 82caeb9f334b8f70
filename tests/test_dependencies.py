"""The dependency split of pyproject.toml and the CI lock: what a trainer's `pip install nemo-is-plugin` brings (the
loss and its kernels' needs, no demo or command-line stack), what the modules it imports import, and that
requirements/ci.lock pins every declared requirement at a version that satisfies it.

The install itself, in a clean virtual environment, is functional_tests/test_clean_install.py."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from _clean_install_check import CORE_MODULES  # what a trainer imports: one list for both dependency checks
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

REPO = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
LOCK = REPO / "requirements" / "ci.lock"
APP_STACK = {"ray", "matplotlib", "typer", "rich", "pyarrow", "click"}


def _requirements(extra: str | None = None) -> list[Requirement]:
    """The core requirements, or an extra's with the extras it names of the project itself expanded."""
    if extra is None:
        return [Requirement(r) for r in PROJECT["dependencies"]]
    out = []
    for r in map(Requirement, PROJECT["optional-dependencies"][extra]):
        if canonicalize_name(r.name) == canonicalize_name(PROJECT["name"]):
            out += [q for e in sorted(r.extras) for q in _requirements(e)]
        else:
            out.append(r)
    return out


def _names(reqs: list[Requirement]) -> set[str]:
    return {canonicalize_name(r.name) for r in reqs}


def _lock() -> dict[str, str]:
    pins = {}
    for line in LOCK.read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([0-9][0-9A-Za-z.!+-]*)", line)
        assert m, f"{LOCK.name}: {line!r} is not an exact `name==version` pin"
        name = canonicalize_name(m.group(1))
        assert name not in pins, f"{LOCK.name} pins {name} twice"
        pins[name] = m.group(2)
    return pins


def test_core_dependencies_are_what_the_loss_imports_and_no_app_stack():
    core = _names(_requirements())
    assert core == {"torch", "pydantic", "omegaconf", "pyyaml", "numpy"}
    assert not core & APP_STACK


def test_megatron_core_is_an_extra_open_to_the_trainers_build():
    """megatron-core comes with the `megatron` extra (a lower bound only: a trainer's own build is kept) and with the
    demo, in the range the demo was tested with."""
    (megatron,) = _requirements("megatron")
    assert canonicalize_name(megatron.name) == "megatron-core" and str(megatron.specifier) == ">=0.12"
    demo = [r for r in _requirements("demo") if canonicalize_name(r.name) == "megatron-core"]
    assert {str(r.specifier) for r in demo} >= {">=0.12", "<0.20,>=0.16"}


def test_each_extra_brings_its_stack():
    assert {"typer", "rich", "matplotlib", "pyarrow"} <= _names(_requirements("cli"))
    assert {"ray", "megatron-core", "typer"} <= _names(_requirements("demo"))
    assert _names(_requirements("demo")) | {"pytest", "pytest-timeout", "hypothesis", "ruff", "mypy"} <= _names(
        _requirements("test")
    )
    everything = set().union(*(_names(_requirements(e)) for e in PROJECT["optional-dependencies"] if e != "test"))
    assert _names(_requirements("all")) == everything


@pytest.mark.parametrize("extra", [None, "cli", "megatron", "demo", "test"])
def test_the_lock_pins_every_requirement_ci_installs_at_a_version_it_allows(extra):
    pins = _lock()
    for req in _requirements(extra):
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        name = canonicalize_name(req.name)
        assert name in pins, f"{req} ({extra or 'core'}) is not pinned in {LOCK.name}: run `make lock`"
        assert req.specifier.contains(pins[name], prereleases=True), f"{LOCK.name} pins {name}=={pins[name]}: {req}"


def test_the_lock_pins_torch_without_a_local_build_label():
    # `torch==2.13.0` takes the local CPU wheel here and a CUDA build where there is none; `+cpu` would forbid that
    assert "+" not in _lock()["torch"]


def _guards_imports(node: ast.Try) -> bool:
    """``try: import x / except ImportError:``, an optional import."""
    caught = [h.type for h in node.handlers]
    names = {n.id for t in caught if t is not None for n in ast.walk(t) if isinstance(n, ast.Name)}
    return None in caught or bool(names & {"ImportError", "ModuleNotFoundError", "Exception"})


def _is_type_checking(test: ast.expr) -> bool:
    """``if TYPE_CHECKING:`` / ``if typing.TYPE_CHECKING:``: a block only a type checker reads."""
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _module_level_imports(source: str) -> set[str]:
    """Top-level names of the absolute imports a module runs when imported: function bodies, the body of a
    ``try`` that catches ImportError and the body of an ``if TYPE_CHECKING:`` excluded."""
    names: set[str] = set()
    pending = list(ast.parse(source).body)
    while pending:
        node = pending.pop()
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
        elif isinstance(node, ast.Try) and _guards_imports(node):
            pending += node.orelse + node.finalbody + [s for h in node.handlers for s in h.body]
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            pending += node.orelse
        elif not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            pending += [c for c in ast.iter_child_nodes(node) if isinstance(c, ast.stmt)]
    return names


def test_module_level_imports_skip_function_bodies_and_guarded_imports():
    source = (
        "import os, torch.nn\nfrom yaml import safe_load\nfrom . import sibling\n"
        "try:\n    import triton\nexcept ImportError:\n    import fallback\n"
        "try:\n    import unguarded\nexcept KeyError:\n    pass\n"
        "if True:\n    import numpy\n"
        "class A:\n    import pydantic\n"
        "def f():\n    import ray\n"
    )
    assert _module_level_imports(source) == {"os", "torch", "yaml", "fallback", "unguarded", "numpy", "pydantic"}


def test_type_checking_imports_are_not_run_at_import():
    source = (
        "import typing\nfrom typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    import pydantic_core\nelse:\n    import json\n"
        "if typing.TYPE_CHECKING:\n    from vllm import LLM\n"
        "if not TYPE_CHECKING:\n    import numpy\n"
    )
    assert _module_level_imports(source) == {"typing", "json", "numpy"}


def test_the_modules_a_trainer_imports_import_only_core_dependencies():
    """Import the trainer-facing modules and dump rollouts in a fresh interpreter; every module of the package that
    this loads may import
    at module level only the standard library, the package itself and the core dependencies' distributions, and none of
    the app stack may end up loaded."""
    script = (
        "import importlib, json, sys, tempfile, torch\n"
        f"for m in {CORE_MODULES!r}: importlib.import_module(m)\n"
        "from nemo_is_plugin.adapters.nemo_rl import dump_rollouts\n"
        "ones = torch.ones(2, 4)\n"
        "data = dict(prev_logprobs=-ones, generation_logprobs=-ones, token_mask=ones, advantages=ones,\n"
        "            sample_mask=torch.ones(2))\n"
        "with tempfile.TemporaryDirectory() as tmp: assert dump_rollouts(data, 0, tmp + '/d.jsonl') == 2\n"
        "mods = {n: getattr(m, '__file__', None) for n, m in list(sys.modules.items())}\n"
        "print(json.dumps(mods))\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    loaded = json.loads(proc.stdout)
    stack = sorted({m.split(".")[0] for m in loaded} & {"ray", "matplotlib", "typer", "rich", "pyarrow", "megatron"})
    assert not stack, f"importing the trainer-facing modules loads {stack}: import them where they are used"

    from importlib.metadata import packages_distributions

    dists_of = packages_distributions()
    core = _names(_requirements())
    for name, path in sorted(loaded.items()):
        if not name.startswith("nemo_is_plugin") or not path:
            continue
        for top in _module_level_imports(Path(path).read_text()):
            if top in sys.stdlib_module_names or top in ("nemo_is_plugin", "__future__"):
                continue
            dists = {canonicalize_name(d) for d in dists_of.get(top, [])}
            assert dists & core, (
                f"{name} imports {top} ({sorted(dists) or 'not installed'}) at module level: "
                f"declare it in [project] dependencies or import it where it is used"
            )
