"""nemo-is-plugin startup hook (this marker line lets the hook skip itself when it looks for the next sitecustomize).

Python imports the first ``sitecustomize`` module on ``sys.path`` at start-up, and ``PYTHONPATH`` directories come
first; a ``.pth`` file in a ``PYTHONPATH`` directory is not processed. So this file is how the plugin acts in a
process it does not start, reached the way the plugin reaches NeMo-RL's workers (its directory on ``PYTHONPATH``,
which NeMo-RL forwards from the driver's environment into every Ray worker's runtime environment).

It does nothing unless ``NEMO_IS_NEMO_RL_HEAD`` is set (and not ``0``). Then it registers, with the standard library
only (no torch, no import of the plugin at start-up), a callback on the import of ``nemo_rl.distributed.model_utils``:
when NeMo-RL imports that module, the callback imports ``nemo_is_plugin.adapters.nemo_rl.head`` and replaces NeMo-RL's
fused log-prob function by the plugin's head, or raises, which fails NeMo-RL's import (a missing plugin, a changed
NeMo-RL, an invalid switch value), never leaving NeMo-RL's own head running unnoticed.

Then it runs the ``sitecustomize`` this one shadows (the next one on ``sys.path``, if any), as Python would have.
"""

import importlib.util as _util
import os as _os
import sys as _sys

_MARKER = b"nemo-is-plugin startup hook"
_SWITCHES = {"NEMO_IS_NEMO_RL_HEAD": ("nemo_rl.distributed.model_utils", "nemo_is_plugin.adapters.nemo_rl.head")}


def _exec_file(name, path):
    spec = _util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = _util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _load_import_hooks():
    # this file is nemo_is_plugin/adapters/nemo_rl/startup/sitecustomize.py; the hooks, adapters/import_hooks.py
    adapters = _os.path.dirname(_os.path.dirname(_os.path.dirname(_os.path.abspath(__file__))))
    return _exec_file("_nemo_is_startup_import_hooks", _os.path.join(adapters, "import_hooks.py"))


def _callback(env, adapter):
    def patch(module):
        import importlib

        try:
            head = importlib.import_module(adapter)
        except ImportError as exc:
            raise ImportError(
                f"{env}={_os.environ.get(env)} asks for the plugin's head in {module.__name__}, but {adapter} does not "
                f"import in this process ({exc}): put the plugin's source directory on PYTHONPATH, or install it here"
            ) from exc
        head.patch_if_switched_on(module)

    return patch


def _install():
    wanted = [(env, target) for env, target in _SWITCHES.items() if _os.environ.get(env, "") not in ("", "0")]
    if not wanted:
        return
    hooks = _load_import_hooks()
    for env, (module, adapter) in wanted:
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


if __name__ in ("sitecustomize", "_nemo_is_startup"):  # run by Python at start-up, or by the repository root's shim
    _install()
    _chain()
