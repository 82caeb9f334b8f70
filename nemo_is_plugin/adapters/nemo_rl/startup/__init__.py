"""The plugin's interpreter start-up hook, for host processes the plugin does not start (NeMo-RL's Ray workers).

``sitecustomize.py`` in this directory is what Python runs at start-up when this directory (or the repository root,
whose ``sitecustomize.py`` loads this one) is on ``PYTHONPATH``; see that file. ``HOOK_DIR`` is the directory to put
on ``PYTHONPATH`` for an installed (not source-tree) plugin:

    export PYTHONPATH=$(python -c "import nemo_is_plugin.adapters.nemo_rl.startup as s; print(s.HOOK_DIR)"):$PYTHONPATH

:func:`check_switch_in_effect` is the run-time side: the hook can fail to run without a word (another
``sitecustomize`` first on ``sys.path``, its folder not on ``PYTHONPATH``, ``python -I`` / ``-E``, an error inside it
that ``site.py`` prints as one "Error in sitecustomize" line), so the plugin's NeMo-RL loss calls it on every call and
stops the run when the switch is on and NeMo-RL's fused log-prob function is not the plugin's.
"""

import os
import sys

HOOK_DIR = os.path.dirname(os.path.abspath(__file__))
SWITCH_ENV = "NEMO_IS_NEMO_RL_HEAD"  # = adapters/nemo_rl/head.py's (no import of it here: it imports torch)
TARGET_MODULE, TARGET = "nemo_rl.distributed.model_utils", "from_parallel_hidden_states_to_logprobs"


class SwitchNotInEffectError(RuntimeError):
    """``NEMO_IS_NEMO_RL_HEAD=1`` in a process whose NeMo-RL runs its own fused log-prob head."""


def check_switch_in_effect() -> None:
    """Raise :class:`SwitchNotInEffectError` (one line: the cause and the fix) when ``NEMO_IS_NEMO_RL_HEAD=1`` and
    NeMo-RL's ``model_utils`` is imported in this process but its ``from_parallel_hidden_states_to_logprobs`` is not
    the plugin's. Two dictionary look-ups: cheap enough for every loss call."""
    if os.environ.get(SWITCH_ENV) != "1":
        return
    module = sys.modules.get(TARGET_MODULE)
    if module is None or getattr(getattr(module, TARGET, None), "nemo_is_head", False):
        return
    hooked = TARGET_MODULE in getattr(sys, "_nemo_is_after_import_callbacks", {})
    cause = (
        "the start-up hook was registered but did not patch it"
        if hooked
        else "the plugin's start-up hook did not run in this process (its folder not on PYTHONPATH, another "
        "sitecustomize before it, python -I / -E, or an 'Error in sitecustomize' line)"
    )
    raise SwitchNotInEffectError(
        f"{SWITCH_ENV}=1 but NeMo-RL's {TARGET_MODULE}.{TARGET} is NeMo-RL's own: {cause}; put {HOOK_DIR} first on "
        f"the workers' PYTHONPATH and check with `python -m nemo_is_plugin.adapters.head_check nemo-rl`, or unset "
        f"{SWITCH_ENV}"
    )


__all__ = ["HOOK_DIR", "SwitchNotInEffectError", "check_switch_in_effect"]
