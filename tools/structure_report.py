"""The package's structure in numbers: lines per layer, imports that point up a layer, and import cycles.

    python -m tools.structure_report [--root REPO] [--json]

``--root`` is a checkout of the repository (default: this one), so the same rules measure an older commit (a
``git worktree`` of it). Every ``import`` / ``from ... import`` of every module under ``nemo_is_plugin/`` counts,
including those inside functions (``lazy``: a dependency all the same) and those under ``if TYPE_CHECKING:``
(``typing``: annotations only, never executed; reported apart), and a package that imports its modules by discovery
(``pkgutil.iter_modules(__path__)``) imports each of them. A module's layer is its directory, with no exception:

    common -> config -> loss (loss/objectives is one of its rows) -> kernels -> distributed -> adapters -> apps

The package root (``__init__``, ``registry``) re-exports the loss and ranks with it; ``recipes`` re-exports
``adapters/recipes.py`` and ranks with the adapters. An import is *upward* when its target ranks above its module.
Cycles are the strongly connected components (Tarjan) of the module graph, once without the ``typing`` imports
(what runs) and once with them. tests/test_layers.py enforces the layers with the parser and cycle finder here.
Lines: ``lines`` is every line of the files, ``code`` leaves out blank lines, comments and docstrings.
"""

from __future__ import annotations

import argparse
import ast
import io
import json
import sys
import tokenize
from dataclasses import dataclass
from pathlib import Path

PACKAGE = "nemo_is_plugin"
REPO = Path(__file__).resolve().parents[1]
# Report rows, bottom to top; RANK is what "upward" compares (loss/objectives is a row of the loss layer).
ROWS = ("root", "common", "config", "loss", "loss/objectives", "kernels", "distributed", "adapters", "apps")
RANK = {
    "common": 0,
    "config": 1,
    "loss": 2,
    "loss/objectives": 2,
    "kernels": 3,
    "distributed": 4,
    "adapters": 5,
    "apps": 6,
}
# The package root's modules: where their re-exports come from.
ROOT_RANK = {PACKAGE: RANK["loss"], f"{PACKAGE}.registry": RANK["loss"], f"{PACKAGE}.recipes": RANK["adapters"]}
LONG_FILE = 400  # the house rule: files under ~400 lines


@dataclass(frozen=True)
class Import:
    target: str  # the package module it loads, or the third-party name
    line: int
    typing: bool  # under ``if TYPE_CHECKING:``
    lazy: bool  # inside a function


def module_name(path: Path, package_dir: Path) -> str:
    parts = path.relative_to(package_dir.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_modules(package_dir: Path) -> dict[str, Path]:
    return {module_name(p, package_dir): p for p in sorted(package_dir.rglob("*.py"))}


def _type_checking_lines(tree: ast.AST) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                lines.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return lines


def _function_lines(tree: ast.AST) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            lines.update(range(node.lineno, (node.end_lineno or node.lineno) + 1))
    return lines


def module_imports(module: str, modules: dict[str, Path]) -> list[Import]:
    """Every import statement of ``module``; a package-internal ``from pkg import name`` loads ``pkg.name`` when that
    is a module, else ``pkg`` itself (its ``__init__``)."""
    path = modules[module]
    tree = ast.parse(path.read_text(), filename=str(path))
    typing_only, in_function = _type_checking_lines(tree), _function_lines(tree)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: list[Import] = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        out += [Import(name, node.lineno, node.lineno in typing_only, node.lineno in in_function) for name in names]
    return out


def discovered_modules(module: str, modules: dict[str, Path]) -> set[str]:
    """The modules a package imports by discovery (``pkgutil.iter_modules(__path__)`` in its ``__init__``, as
    ``loss/objectives`` does): each public module directly in it, an import that no statement names."""
    path = modules[module]
    if path.name != "__init__.py" or "iter_modules(__path__)" not in path.read_text():
        return set()
    prefix = module + "."
    return {m for m in modules if m.startswith(prefix) and "." not in m[len(prefix) :] and m[len(prefix)] != "_"}


def import_graph(modules: dict[str, Path], *, include_typing: bool) -> dict[str, set[str]]:
    return {
        module: {
            i.target
            for i in module_imports(module, modules)
            if i.target in modules and (include_typing or not i.typing)
        }
        | discovered_modules(module, modules)
        for module in modules
    }


def find_cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (or a module importing itself), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(edges.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1 or node in edges.get(node, ()):
                cycles.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return cycles


def row_of(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1 or parts[1] in ("registry", "recipes"):
        return "root"
    if parts[1] == "loss" and len(parts) > 2 and parts[2] == "objectives":
        return "loss/objectives"
    return parts[1]


def rank_of(module: str) -> int:
    return ROOT_RANK[module] if row_of(module) == "root" else RANK[row_of(module)]


def code_lines(source: str) -> int:
    """Lines holding code: not blank, not only a comment, not part of a docstring."""
    tree = ast.parse(source)
    docstrings: set[int] = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body:
            first = body[0]
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                docstrings.update(range(first.lineno, (first.end_lineno or first.lineno) + 1))
    skip = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENCODING}
    lines: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type not in skip and tok.type != tokenize.ENDMARKER:
            lines.update(range(tok.start[0], tok.end[0] + 1))
    return len(lines - docstrings)


def _kind(i: Import) -> str:
    return "typing" if i.typing else "lazy" if i.lazy else "import"


def report(root: Path) -> dict:
    package_dir = root / PACKAGE
    modules = package_modules(package_dir)
    rows = {row: {"files": 0, "lines": 0, "code": 0, f"files_over_{LONG_FILE}": 0} for row in ROWS}
    for module, path in modules.items():
        text = path.read_text()
        row = rows[row_of(module)]
        n = len(text.splitlines())
        row["files"] += 1
        row["lines"] += n
        row["code"] += code_lines(text)
        row[f"files_over_{LONG_FILE}"] += n > LONG_FILE
    upward = sorted(  # one entry per import statement and module it loads
        {
            (str(modules[module].relative_to(root)), i.line, i.target, row_of(module), row_of(i.target), _kind(i))
            for module in modules
            for i in module_imports(module, modules)
            if i.target in modules and rank_of(i.target) > rank_of(module)
        }
    )
    return {
        "root": str(root),
        "rows": rows,
        "total": {key: sum(row[key] for row in rows.values()) for key in rows["root"]},
        "upward": [dict(zip(("module", "line", "imports", "from", "to", "kind"), u)) for u in upward],
        "cycles": find_cycles(import_graph(modules, include_typing=False)),
        "cycles_with_typing": find_cycles(import_graph(modules, include_typing=True)),
    }


def print_report(data: dict) -> None:
    print(f"structure of {data['root']}/{PACKAGE}")
    keys = list(data["total"])
    print(f"{'layer':<16}" + "".join(f"{k:>16}" for k in keys))
    for row, counts in [*data["rows"].items(), ("total", data["total"])]:
        print(f"{row:<16}" + "".join(f"{counts[k]:>16}" for k in keys))
    kinds = {kind: sum(u["kind"] == kind for u in data["upward"]) for kind in ("import", "lazy", "typing")}
    print(f"upward imports: {len(data['upward'])} ({', '.join(f'{k} {v}' for k, v in kinds.items())})")
    for u in data["upward"]:
        print(f"  {u['module']}:{u['line']}: {u['from']} imports {u['imports']} ({u['to']}; {u['kind']})")
    for label, key in (
        ("import cycles", "cycles"),
        ("import cycles counting TYPE_CHECKING imports", "cycles_with_typing"),
    ):
        print(f"{label}: {len(data[key])}")
        for cycle in data[key]:
            print("  " + " <-> ".join(cycle))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=REPO, help="a checkout of the repository (default: this one)")
    parser.add_argument("--json", action="store_true", help="print the numbers as JSON")
    args = parser.parse_args(argv)
    if not (args.root / PACKAGE).is_dir():
        parser.error(f"--root {args.root}: no {PACKAGE}/ in it; give a checkout of the repository")
    data = report(args.root.resolve())
    if args.json:
        json.dump(data, sys.stdout, indent=1)
        print()
    else:
        print_report(data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
