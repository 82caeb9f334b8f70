"""nemo-is-plugin startup hook, for the repository root on PYTHONPATH (runs the package's hook, see below).

With this directory on ``PYTHONPATH``, Python runs this file at start-up; it executes
``nemo_is_plugin/adapters/nemo_rl/startup/hook/sitecustomize.py``, which does nothing unless ``NEMO_IS_NEMO_RL_HEAD``
is set, and which then runs the ``sitecustomize`` these two shadow. docs/nemo_rl.md ("how the plugin reaches
NeMo-RL's workers") recommends that hook's own folder on ``PYTHONPATH`` instead (or an installed plugin), which puts
nothing else of the repository (tools/, scripts/, conftest.py) on every worker's path; this file keeps the repository
root working for the setups that use it.
"""

import os as _os

_here = _os.path.dirname(_os.path.abspath(__file__))
_hook = _os.path.join(_here, "nemo_is_plugin", "adapters", "nemo_rl", "startup", "hook", "sitecustomize.py")
with open(_hook) as _fh:
    exec(compile(_fh.read(), _hook, "exec"), {"__file__": _hook, "__name__": "_nemo_is_startup"})
