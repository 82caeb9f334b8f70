"""The package's layers only point down, and no two modules import each other (directly or through others).

Every ``import`` / ``from ... import`` statement of every module under ``nemo_is_plugin/`` counts, including those
inside functions (a lazy import is still a dependency). Layers, bottom to top:

    base (common/) -> config -> loss -> kernels -> distributed -> integration (adapters/) -> apps (apps/)

A module may import from its own layer and the layers below it, so the runtime (everything below the apps) never
imports an app. The ground floor, ``nemo_is_plugin.common``, is what every layer may import (``warn_once``, the extras'
errors); it imports no other package module and no third-party package. The kernels are the chunk math of the
log-prob paths and know nothing of the loss or its config: they import neither, although both rank below them. No
cycle either among what runs or counting the imports under ``if TYPE_CHECKING:`` (annotations only, never executed: the
objective modules annotate with ``ObjectiveConfig``, a Protocol the assembled config satisfies, not with the config that
imports them). ``from pkg import name`` depends on ``pkg.name`` when that is a module, else on ``pkg`` itself (its
``__init__``); a package that imports its modules by discovery (``loss/objectives``) depends on each of them.

The config layer is the config's schema: how a key is typed, ranged and explained, the generic combination checks, the
unknown-key policy, the errors, rejection rules, and ``KeySection`` (what a policy objective declares its keys as). A
policy objective is one module (``loss/objectives/<name>.py``) holding its formula (torch) and its keys together, so the
assembled ``ClippedPGLossConfig`` (generic keys plus every registered objective's section: ``loss/config_model.py``)
is built above the objective modules, in the loss layer; the config package imports nothing from it, not even lazily,
and every module's layer is its package's (no exception). No module of the config package imports torch. The parser
and the cycle finder are tools/structure_report.py's, which prints the same graph in numbers (docs/design.md, *Layers*).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tools.structure_report import find_cycles, import_graph, module_imports, package_modules

PACKAGE = "nemo_is_plugin"
ROOT = Path(__file__).resolve().parents[1] / PACKAGE

LAYERS = ("base", "config", "loss", "kernels", "distributed", "integration", "apps")
# Module prefix -> layer; the longest matching prefix wins. The package root (``nemo_is_plugin/__init__.py``) and the
# ``nemo_is_plugin.registry`` / ``nemo_is_plugin.recipes`` / ``nemo_is_plugin.objectives`` (the authors' API) modules
# re-export documented names from the layers below.
LAYER_OF_PREFIX = {
    "nemo_is_plugin": "loss",
    "nemo_is_plugin.common": "base",
    "nemo_is_plugin.config": "config",
    "nemo_is_plugin.loss": "loss",
    "nemo_is_plugin.registry": "loss",
    "nemo_is_plugin.objectives": "loss",
    "nemo_is_plugin.kernels": "kernels",
    "nemo_is_plugin.distributed": "distributed",
    "nemo_is_plugin.adapters": "integration",
    "nemo_is_plugin.recipes": "integration",
    "nemo_is_plugin.apps": "apps",
}
# Documented import paths kept for users; no module of the package imports them.
REEXPORT_MODULES = ("nemo_is_plugin.registry", "nemo_is_plugin.recipes", "nemo_is_plugin.objectives")
# Third-party packages the modules under a package prefix must not import: no config module imports torch (the
# objective modules the assembled config reads do, and are in the loss package).
FORBIDDEN_THIRD_PARTY = {
    "nemo_is_plugin.config": ("torch", "triton", "megatron", "omegaconf", "yaml"),
    "nemo_is_plugin.common": ("torch", "triton", "megatron", "omegaconf", "yaml", "pydantic", "numpy"),
}
# Layers a package must not import although they rank below it: the kernels compute on chunks of logits and take
# every setting as an argument, so neither the loss nor its config reaches them.
UNRELATED_LAYERS = {"nemo_is_plugin.kernels": ("config", "loss")}


MODULES = package_modules(ROOT)


def layer_of(module: str) -> str:
    prefix = max((p for p in LAYER_OF_PREFIX if module == p or module.startswith(p + ".")), key=len)
    return LAYER_OF_PREFIX[prefix]


def imports(module: str) -> list[tuple[str, int, bool]]:
    """``(imported name, line, only under TYPE_CHECKING)`` for every import statement of ``module`` (lazy ones too);
    package-internal names are resolved to the module they load."""
    return [(i.target, i.line, i.typing) for i in module_imports(module, MODULES)]


def test_every_module_has_a_layer():
    assert set(LAYER_OF_PREFIX.values()) == set(LAYERS)
    top = {
        p.name if p.is_dir() else p.stem
        for p in ROOT.iterdir()
        if p.name != "__pycache__" and (p.is_dir() or p.suffix == ".py")
    }
    mapped = {prefix.split(".")[1] for prefix in LAYER_OF_PREFIX if prefix != PACKAGE} | {"__init__"}
    assert top <= mapped, f"add a layer for {sorted(top - mapped)} to LAYER_OF_PREFIX"


def test_layers_only_point_down():
    rank = {layer: i for i, layer in enumerate(LAYERS)}
    upward = [
        f"{MODULES[module].relative_to(ROOT.parent)}:{line}: {layer_of(module)} imports {name} ({layer_of(name)})"
        for module in MODULES
        for name, line, _ in imports(module)
        if name.split(".")[0] == PACKAGE and rank[layer_of(name)] > rank[layer_of(module)]
    ]
    assert not upward, "\n".join(upward)


def test_no_module_imports_the_documented_reexports():
    users = [
        f"{MODULES[module].relative_to(ROOT.parent)}:{line}: imports {name}; import its source module instead"
        for module in MODULES
        for name, line, _ in imports(module)
        if name in REEXPORT_MODULES and module not in REEXPORT_MODULES
    ]
    assert not users, "\n".join(users)


def imports_of_package(package: str, forbidden) -> list[str]:
    """``path:line: imports name`` for every import of a module of ``package`` that ``forbidden(name)`` refuses."""
    return [
        f"{MODULES[module].relative_to(ROOT.parent)}:{line}: imports {name}"
        for module in MODULES
        if module == package or module.startswith(package + ".")
        for name, line, _ in imports(module)
        if forbidden(name)
    ]


@pytest.mark.parametrize("package", sorted(UNRELATED_LAYERS))
def test_package_imports_no_unrelated_layer(package):
    bad = imports_of_package(
        package, lambda name: name.split(".")[0] == PACKAGE and layer_of(name) in UNRELATED_LAYERS[package]
    )
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("package", sorted(FORBIDDEN_THIRD_PARTY))
def test_package_imports_no_forbidden_third_party_package(package):
    bad = imports_of_package(package, lambda name: name.split(".")[0] in FORBIDDEN_THIRD_PARTY[package])
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("include_typing", [False, True], ids=["run-time", "with-TYPE_CHECKING"])
def test_no_import_cycles(include_typing):
    cycles = find_cycles(import_graph(MODULES, include_typing=include_typing))
    assert not cycles, "modules that import each other: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_the_checks_see_upward_imports_and_cycles():
    """The checkers themselves: a planted upward edge and a planted cycle are found."""
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []
    assert layer_of("nemo_is_plugin.kernels.chunk_math") == "kernels"
    assert layer_of("nemo_is_plugin.common.once") == "base"
    # the package check sees a package's imports (the entry points import the loss, two layers below them)
    assert imports_of_package("nemo_is_plugin.distributed.entry_points", lambda n: n.startswith("nemo_is_plugin.loss"))
    assert {name for name, _, _ in imports("nemo_is_plugin.kernels.chunk_math")} >= {"nemo_is_plugin.common.once"}
    assert layer_of("nemo_is_plugin.distributed.head.vocab_parallel") == "distributed"
    assert layer_of("nemo_is_plugin.adapters.nemo_rl") == "integration"
    assert layer_of("nemo_is_plugin.apps.cli.main") == layer_of("nemo_is_plugin.apps.demo.loop") == "apps"
    assert layer_of("nemo_is_plugin") == "loss"
    # the config's schema is the bottom layer; the config assembled from the objectives' key sections is above them
    assert layer_of("nemo_is_plugin.config.keys") == "config"
    assert layer_of("nemo_is_plugin.loss.config_model") == "loss"
    assert {name for name, _, _ in imports("nemo_is_plugin.loss.config_model")} >= {"nemo_is_plugin.loss.objectives"}
    # the objectives package imports its modules by discovery: the graph holds those edges, so an objective module
    # that names the assembled config, even under TYPE_CHECKING, closes a cycle the check above sees
    objectives = "nemo_is_plugin.loss.objectives"
    assert f"{objectives}.sapo" not in {name for name, _, _ in imports(objectives)}
    assert f"{objectives}.sapo" in import_graph(MODULES, include_typing=False)[objectives]
    planted = {**import_graph(MODULES, include_typing=True), f"{objectives}.sapo": {"nemo_is_plugin.loss.config_model"}}
    assert [c for c in find_cycles(planted) if {f"{objectives}.sapo", "nemo_is_plugin.loss.config_model"} <= set(c)]
    # the config package imports nothing of the loss (it re-exported the assembled model lazily until issue 38)
    assert not [name for name, _, _ in imports("nemo_is_plugin.config") if name.startswith("nemo_is_plugin.loss")]
    # a lazy import inside a function counts: the NeMo-RL adapter builds the LOGIT loss that way
    adapter_imports = {name for name, _, _ in imports("nemo_is_plugin.adapters.nemo_rl.loss_fn")}
    assert "nemo_is_plugin.distributed.entry_points.logit_loss" in adapter_imports


def test_score_centering_sits_with_the_terms_math():
    """Score centering's term is a sibling of the other terms' math (the KL, the IS correction), not a floor above the
    metrics machinery: at run time it imports only leaves of the loss package (modules that import no other module of
    it), e.g. ``Denominator``'s module rather than metrics.py."""
    term = "nemo_is_plugin.loss.score_centering"

    def runtime_loss_imports(module: str) -> set[str]:
        return {n for n, _, typing in imports(module) if not typing and n.startswith("nemo_is_plugin.loss.")}

    used = runtime_loss_imports(term)
    assert "nemo_is_plugin.loss.denominator" in used and "nemo_is_plugin.loss.metrics" not in used
    not_leaves = {n: sorted(runtime_loss_imports(n)) for n in used if runtime_loss_imports(n)}
    assert not not_leaves, f"{term} imports modules above the loss's leaves: {not_leaves}"
