"""The plugin's interpreter start-up hook, for host processes the plugin does not start (NeMo-RL's Ray workers).

``hook/sitecustomize.py`` is the hook; three ways run it at interpreter start (that file says how): an installed
plugin's ``nemo_is_plugin_startup.pth`` (this folder's copy is the source ``setup.py`` installs at the root of
site-packages), ``HOOK_DIR`` -- the ``hook`` folder, which holds the hook alone -- on ``PYTHONPATH``, or the
repository root on ``PYTHONPATH``. ``HOOK_DIR`` is printed by

    python -c "import nemo_is_plugin.adapters.nemo_rl.startup as s; print(s.HOOK_DIR)"

It does two things: always, ``loss_switch.py`` (NeMo-RL's ``ClippedPGLossFn`` builds the plugin's loss for a
``loss_fn`` whose ``name`` is the plugin's: the plugin on from NeMo-RL's config alone); with ``NEMO_IS_NEMO_RL_HEAD=1``,
NeMo-RL's fused log-prob function replaced by the plugin's head.

:func:`check_switch_in_effect` is the run-time side: the hook can still not run (the plugin neither installed in the
worker's environment nor its folder on ``PYTHONPATH``, another ``sitecustomize`` first on ``sys.path`` for a
``PYTHONPATH`` hook, ``python -S``, ``-I`` / ``-E`` for a ``PYTHONPATH`` hook, an error inside it that ``site.py``
prints as one "Error in sitecustomize" / "Error processing line" message and goes on), so the plugin's NeMo-RL loss
calls it on every call and stops the run when the switch is on and NeMo-RL's fused log-prob function is not the
plugin's.
"""

import os
import sys

HOOK_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hook")
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
        else "the plugin's start-up hook did not run in this process (the plugin not installed in this environment "
        "and its hook folder not on PYTHONPATH, another sitecustomize before it, python -S, or an error printed by "
        "site.py at start-up)"
    )
    raise SwitchNotInEffectError(
        f"{SWITCH_ENV}=1 but NeMo-RL's {TARGET_MODULE}.{TARGET} is NeMo-RL's own: {cause}; install the plugin in "
        f"the workers' environment or put {HOOK_DIR} first on their PYTHONPATH, and check with `python -m "
        f"nemo_is_plugin.adapters.head_check nemo-rl`, or unset {SWITCH_ENV}"
    )


__all__ = ["HOOK_DIR", "SwitchNotInEffectError", "check_switch_in_effect"]
