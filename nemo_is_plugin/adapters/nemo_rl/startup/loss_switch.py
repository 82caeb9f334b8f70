"""NeMo-RL builds the plugin's loss when its config names it: ``loss_fn.name: nemo_is.clipped_pg``.

NeMo-RL has no loss registry: ``grpo.setup``, ``ppo.setup`` and the single-controller setup each build
``ClippedPGLossFn(master_config.loss_fn, ...)`` (NVIDIA-NeMo/RL @7ea279ab: nemo_rl/algorithms/grpo.py:695,
ppo.py:476, single_controller_utils/setup.py:787), all three the one class of
``nemo_rl/algorithms/loss/loss_functions.py``, and NeMo-RL's config model keeps unknown ``loss_fn`` keys
(``ClippedPGLossConfig(BaseModel, extra="allow")``), ``name`` and the plugin's keys among them. The plugin's start-up
hook (``hook/sitecustomize.py``, run in every interpreter of an environment the plugin is installed in) registers
:func:`patch` on the import of that module; it gives NeMo-RL's class a ``__new__`` that, for a config whose ``name``
starts with ``nemo_is.``, returns the plugin's ``NeMoRLLossFn`` built from the same arguments, and otherwise makes
NeMo-RL's own object as before (the class, its ``__init__``, pickling and ``isinstance`` unchanged). The loss reaches
NeMo-RL's workers pickled from the driver, so the driver is where the choice is made.

Standard library only, and no import of the plugin until a config names it: the hook loads this file by path when
NeMo-RL's module is imported (``nemo_is_plugin.adapters.nemo_rl.startup.loss_switch`` is the same file imported
normally, for the checks). A NeMo-RL without that class is left alone (the hook must never break a NeMo-RL run that
does not name the plugin); ``python -m nemo_is_plugin.adapters.head_check nemo-rl-loss`` reports it.
"""

import importlib
import importlib.util
import sys
from collections.abc import Mapping

TARGET_MODULE, TARGET_CLASS = "nemo_rl.algorithms.loss.loss_functions", "ClippedPGLossFn"
PREFIX = "nemo_is."  # the plugin's registered losses (nemo_is_plugin/registry.py)
ADAPTER = "nemo_is_plugin.adapters.nemo_rl"
HOOK_KEY = "nemo_is.loss_fn_name"  # the callback's key in the after-import registry (import_hooks.py)
MARK = "nemo_is_loss_switch"  # set on the __new__ this file installs


def plugin_name(cfg: object) -> "str | None":
    """The loss config's ``name`` when it names one of the plugin's losses, else None. ``cfg`` is NeMo-RL's pydantic
    ``ClippedPGLossConfig`` (extra keys are attributes) or a mapping."""
    name = cfg.get("name") if isinstance(cfg, Mapping) else getattr(cfg, "name", None)
    return name if isinstance(name, str) and name.startswith(PREFIX) else None


def _plugin_loss(name: str, args: tuple, kwargs: dict) -> object:
    try:
        adapter = importlib.import_module(ADAPTER)
    except ImportError as exc:
        raise ImportError(
            f"NeMo-RL's loss_fn.name is {name!r} but the plugin does not import in this process ({exc}): install "
            "nemo-is-plugin with its dependencies in this environment, or remove loss_fn.name to run NeMo-RL's "
            "ClippedPGLossFn"
        ) from exc
    return adapter.NeMoRLLossFn(*args, **kwargs)


def _switching_new(cls: type, previous: object):
    def __new__(klass, *args, **kwargs):
        cfg = args[0] if args else kwargs.get("cfg")
        name = plugin_name(cfg) if klass is cls and cfg is not None else None
        if name is not None:
            return _plugin_loss(name, args, kwargs)  # not a ClippedPGLossFn: Python then skips its __init__
        if previous is object.__new__:
            return object.__new__(klass)
        return previous(klass, *args, **kwargs)  # type: ignore[operator]

    setattr(__new__, MARK, True)
    return __new__


def patch(module: object) -> None:
    """Give ``module.ClippedPGLossFn`` the plugin's ``__new__`` (once); a module without that class is left alone."""
    cls = getattr(module, TARGET_CLASS, None)
    if not isinstance(cls, type) or is_patched(cls):
        return
    cls.__new__ = staticmethod(_switching_new(cls, cls.__new__))  # type: ignore[method-assign]


def is_patched(cls: type) -> bool:
    new = cls.__dict__.get("__new__")
    return bool(getattr(getattr(new, "__func__", new), MARK, False))


def status() -> dict:
    """What this interpreter does with ``loss_fn.name``: whether the hook registered the switch, and, if NeMo-RL's
    loss module is imported, whether its class carries it."""
    registered = HOOK_KEY in getattr(sys, "_nemo_is_after_import_callbacks", {}).get(TARGET_MODULE, {})
    module = sys.modules.get(TARGET_MODULE)
    cls = getattr(module, TARGET_CLASS, None) if module is not None else None
    return {
        "registered": registered,
        "imported": module is not None,
        "class_found": isinstance(cls, type),
        "patched": isinstance(cls, type) and is_patched(cls),
    }


def ignored_name_message(name: str) -> "str | None":
    """One line when NeMo-RL is installed in this interpreter's environment but would ignore ``loss_fn.name``
    (``name``): the switch is not registered here (``python -S``, the plugin on ``PYTHONPATH`` as a plain directory,
    whose ``.pth`` Python does not process, an error in the hook); None otherwise."""
    state = status()
    if state["registered"] or state["patched"] or importlib.util.find_spec("nemo_rl") is None:
        return None
    return (
        f"loss_fn.name is {name!r} but NeMo-RL in this interpreter would build its own ClippedPGLossFn and ignore it: "
        "the plugin's start-up hook did not run here (install the plugin with pip in this environment, or put "
        "nemo_is_plugin/adapters/nemo_rl/startup/hook first on PYTHONPATH; check with `python -m "
        "nemo_is_plugin.adapters.head_check nemo-rl-loss`)"
    )
