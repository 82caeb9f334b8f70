"""The plugin's interpreter start-up hook, for host processes the plugin does not start (NeMo-RL's Ray workers).

``sitecustomize.py`` in this directory is what Python runs at start-up when this directory (or the repository root,
whose ``sitecustomize.py`` loads this one) is on ``PYTHONPATH``; see that file. ``HOOK_DIR`` is the directory to put
on ``PYTHONPATH`` for an installed (not source-tree) plugin:

    export PYTHONPATH=$(python -c "import nemo_is_plugin.adapters.nemo_rl.startup as s; print(s.HOOK_DIR)"):$PYTHONPATH
"""

import os

HOOK_DIR = os.path.dirname(os.path.abspath(__file__))

__all__ = ["HOOK_DIR"]
