"""nemo-is-plugin startup hook (this marker line lets the hook skip itself when it looks for the next sitecustomize).

The plugin's way into processes it does not start (NeMo-RL's Ray workers), run at interpreter start one of three ways
(docs/nemo_rl.md, "how the plugin reaches NeMo-RL's workers"):

- installed plugin: ``nemo_is_plugin_startup.pth``, which the package installs at the root of site-packages, execs
  this file. ``site.py`` processes a site-packages ``.pth`` whatever
  ``sitecustomize`` comes first on ``sys.path`` and under ``python -I`` / ``-E`` (not ``-S``);
- this folder, which holds this file alone, on ``PYTHONPATH``: Python imports the first ``sitecustomize`` module on
  ``sys.path`` at start-up, and ``PYTHONPATH`` directories come first (a ``.pth`` file in a ``PYTHONPATH`` directory
  is not processed). NeMo-RL forwards the driver's environment, ``PYTHONPATH`` included, to every Ray worker. Run this
  way it also appends a last finder to ``sys.meta_path`` that resolves ``nemo_is_plugin`` -- that name alone -- to
  the package around this file when nothing before it does, so that the folder replaces the repository root on
  ``PYTHONPATH`` without putting the repository's tools/, scripts/ or conftest.py on every worker's path; then it
  runs the ``sitecustomize`` this one shadows (the next one on ``sys.path``, if any), as Python would have;
- the repository root on ``PYTHONPATH``: the root's ``sitecustomize.py`` execs this file (and the chain, as above).

Always, with the standard library only (no torch, no import of the plugin at start-up), it registers a callback on the
import of ``nemo_rl.algorithms.loss.loss_functions`` that lets NeMo-RL's ``ClippedPGLossFn`` build the plugin's loss
for a ``loss_fn`` config whose ``name`` is one of the plugin's (``loss_switch.py``; any other config: NeMo-RL's own
object, and the plugin is not imported). With ``NEMO_IS_NEMO_RL_HEAD`` set (and not ``0``) it also registers a
callback on the import of ``nemo_rl.distributed.model_utils``:
when NeMo-RL imports that module, the callback imports ``nemo_is_plugin.adapters.nemo_rl.head`` and replaces NeMo-RL's
fused log-prob function by the plugin's head, or raises, which fails NeMo-RL's import (a missing plugin, a changed
NeMo-RL, an invalid switch value), never leaving NeMo-RL's own head running unnoticed. Where this file never runs,
the plugin's NeMo-RL loss stops the run at its first call (``startup/__init__.py``: ``check_switch_in_effect``).
"""

import importlib.util as _util
import os as _os
import sys as _sys

_MARKER = b"nemo-is-plugin startup hook"
_SWITCHES = {"NEMO_IS_NEMO_RL_HEAD": ("nemo_rl.distributed.model_utils", "nemo_is_plugin.adapters.nemo_rl.head")}
_PACKAGE = "nemo_is_plugin"
# this file is nemo_is_plugin/adapters/nemo_rl/startup/hook/sitecustomize.py
_ADAPTERS_DIR = _os.path.dirname(_os.path.dirname(_os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))))
_PACKAGE_DIR = _os.path.dirname(_ADAPTERS_DIR)
_LOSS_SWITCH = _os.path.join(_ADAPTERS_DIR, "nemo_rl", "startup", "loss_switch.py")
_LOSS_MODULE, _LOSS_KEY = "nemo_rl.algorithms.loss.loss_functions", "nemo_is.loss_fn_name"  # = loss_switch.py's


def _exec_file(name, path):
    spec = _util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = _util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _OwnPackageFinder:
    """Last on ``sys.meta_path``: ``nemo_is_plugin`` from the package this file belongs to, when no finder before it
    (an installed plugin, ``PYTHONPATH``) provides one; no other name."""

    nemo_is_own_package = True  # one instance per process, whichever copy of this file made it

    def find_spec(self, fullname, path=None, target=None):
        init = _os.path.join(_PACKAGE_DIR, "__init__.py")
        if fullname != _PACKAGE or not _os.path.isfile(init):
            return None
        return _util.spec_from_file_location(_PACKAGE, init, submodule_search_locations=[_PACKAGE_DIR])


def _add_own_package_finder():
    if not any(getattr(f, "nemo_is_own_package", False) for f in _sys.meta_path):
        _sys.meta_path.append(_OwnPackageFinder())


def _callback(env, adapter):
    def patch(module):
        import importlib

        try:
            head = importlib.import_module(adapter)
        except ImportError as exc:
            raise ImportError(
                f"{env}={_os.environ.get(env)} asks for the plugin's head in {module.__name__}, but {adapter} does not "
                f"import in this process ({exc}): install the plugin in this environment, or put its start-up folder "
                "(nemo_is_plugin/adapters/nemo_rl/startup/hook of a whole source tree) on PYTHONPATH"
            ) from exc
        head.patch_if_switched_on(module)

    return patch


def _switch_loss(module):
    """NeMo-RL's ``ClippedPGLossFn`` builds the plugin's loss for a ``loss_fn`` naming it (``loss_switch.py``)."""
    _exec_file("_nemo_is_startup_loss_switch", _LOSS_SWITCH).patch(module)


def _install():
    hooks = _exec_file("_nemo_is_startup_import_hooks", _os.path.join(_ADAPTERS_DIR, "import_hooks.py"))
    hooks.when_imported(_LOSS_MODULE, _LOSS_KEY, _switch_loss)  # always: the config decides, at NeMo-RL's import
    for env, (module, adapter) in _SWITCHES.items():
        if _os.environ.get(env, "") not in ("", "0"):
            hooks.when_imported(module, "nemo_is." + env.lower(), _callback(env, adapter))


def _chain():
    """Run the first other ``sitecustomize.py`` on ``sys.path``: the one Python would have run without this one."""
    for entry in _sys.path:
        candidate = _os.path.join(entry or _os.getcwd(), "sitecustomize.py")
        try:
            with open(candidate, "rb") as fh:
                if _MARKER in fh.read(400):
                    continue
        except OSError:
            continue
        _exec_file("_nemo_is_shadowed_sitecustomize", candidate)
        return


if __name__ == "sitecustomize":  # run by Python at start-up: this folder on PYTHONPATH
    _add_own_package_finder()
if __name__ in ("sitecustomize", "_nemo_is_startup", "_nemo_is_startup_pth"):  # _startup: the repository root's shim
    _install()
if __name__ in ("sitecustomize", "_nemo_is_startup"):  # a .pth shadows no sitecustomize: nothing to chain
    _chain()
