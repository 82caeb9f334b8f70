"""What verl's entry point installs when the plugin does not load in a verl process: the plugin's switches stop the
run, in one line naming the import error and the fix, instead of staying on without effect.

verl imports its ``verl.plugins`` entry points at ``import verl`` and logs a failure at DEBUG (``verl/__init__.py``,
the plugin loop). A worker where ``nemo_is_plugin.adapters.verl.plugin`` cannot import (a dependency missing or
broken in that environment) would then run verl's own fused kernel with ``fused_kernel_options.impl_backend=nemo_is``
set -- verl's Megatron engine never reads ``impl_backend`` -- and fail on ``loss_mode=nemo_is.*`` with verl's
"Unsupported loss mode", which does not say why. The entry point catches that failure and calls :func:`install_guard`,
which logs one warning and registers (``adapters/import_hooks.py``) a check at each point where verl would use what the
plugin did not install, all before the first log-prob pass or loss call:

- ``verl.workers.config.model.HFModelConfig.__post_init__`` (every verl worker builds its model config there): a
  config with ``fused_kernel_options.impl_backend=nemo_is``;
- ``verl.workers.engine.megatron.transformer_impl.MegatronEngine._maybe_enable_fused_kernels`` (run while the engine
  initialises, before its first forward; a config built in another process is not re-validated on unpickling) and
  ``verl.models.transformers.monkey_patch.patch_forward_with_backends`` (verl's FSDP models choose their fused forward
  there): the same value;
- ``verl.trainer.ppo.core_algos.get_policy_loss_fn`` (verl's loss-mode look-up): a ``nemo_is.*`` name that is not in
  verl's registry.

Each raises :class:`PluginNotLoadedError`. Standard library only (this module runs where the plugin's dependencies did
not import); the names of verl's modules are ``adapters/verl/head.py``'s (a test checks that they agree).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from types import ModuleType
from typing import Any

from nemo_is_plugin.adapters.import_hooks import when_imported

ENTRY_POINT = "nemo_is_plugin.adapters.verl.plugin"
# what the entry point imports inside its ``try``: importing these shows the traceback it caught
TRACEBACK_CHECK = "import nemo_is_plugin.adapters.verl.head, nemo_is_plugin.adapters.verl.policy_loss"
BACKEND = "nemo_is"  # fused_kernel_options.impl_backend (head.py)
LOSS_PREFIX = "nemo_is."  # the plugin's verl loss modes (policy_loss.py: VERL_LOSS_NAME)
CONFIG_MODULE, CONFIG_CLASS = "verl.workers.config.model", "HFModelConfig"
ENGINE_MODULE, ENGINE_CLASS, ENGINE_METHOD = (
    "verl.workers.engine.megatron.transformer_impl",
    "MegatronEngine",
    "_maybe_enable_fused_kernels",
)
FSDP_PATCH_MODULE, FSDP_PATCH = "verl.models.transformers.monkey_patch", "patch_forward_with_backends"
LOSS_MODULE, LOSS_LOOKUP = "verl.trainer.ppo.core_algos", "get_policy_loss_fn"
_STATE: dict[str, str] = {}  # "error": the import error, one line
logger = logging.getLogger(ENTRY_POINT)


class PluginNotLoadedError(ImportError):
    """A verl setting asks for the plugin in a process where its verl entry point failed to load."""


def _stop(setting: str, consequence: str, fix: str) -> PluginNotLoadedError:
    return PluginNotLoadedError(
        f"{setting} asks for nemo-is-plugin, but its verl entry point ({ENTRY_POINT}) failed to load in this process "
        f"({_STATE['error']}), so {consequence}: fix that import in this worker's environment (`python -c "
        f"'{TRACEBACK_CHECK}'` there shows the traceback), or {fix}"
    )


def _backend_requested(model_config: Any) -> bool:
    options = getattr(model_config, "fused_kernel_options", None) or {}
    return options.get("impl_backend") == BACKEND


def _kernel_stop() -> PluginNotLoadedError:
    return _stop(
        f"fused_kernel_options.impl_backend={BACKEND}",
        "verl would run its own fused kernel",
        "set actor_rollout_ref.model.fused_kernel_options.impl_backend to one of verl's",
    )


def _wrap(owner: Any, name: str, make: Callable[[Callable], Callable]) -> None:
    original = getattr(owner, name, None)
    if original is None or getattr(original, "nemo_is_guard", False):
        return
    wrapper = make(original)
    wrapper.nemo_is_guard = True  # type: ignore[attr-defined]
    setattr(owner, name, wrapper)


def _on_config_module(module: ModuleType) -> None:
    def make(original: Callable) -> Callable:
        def __post_init__(self):
            original(self)
            if _backend_requested(self):
                raise _kernel_stop()

        return __post_init__

    _wrap(getattr(module, CONFIG_CLASS, None), "__post_init__", make)


def _on_engine_module(module: ModuleType) -> None:
    def make(original: Callable) -> Callable:
        def _maybe_enable_fused_kernels(self):
            if _backend_requested(getattr(self, "model_config", None)):
                raise _kernel_stop()
            return original(self)

        return _maybe_enable_fused_kernels

    _wrap(getattr(module, ENGINE_CLASS, None), ENGINE_METHOD, make)


def _on_fsdp_patch_module(module: ModuleType) -> None:
    def make(original: Callable) -> Callable:
        def patch_forward_with_backends(model, use_fused_kernels=False, fused_kernels_backend=None, *args, **kwargs):
            if fused_kernels_backend == BACKEND:
                raise _kernel_stop()
            return original(model, use_fused_kernels, fused_kernels_backend, *args, **kwargs)

        return patch_forward_with_backends

    _wrap(module, FSDP_PATCH, make)


def _on_loss_module(module: ModuleType) -> None:
    def make(original: Callable) -> Callable:
        def get_policy_loss_fn(name, *args, **kwargs):
            registry = getattr(module, "POLICY_LOSS_REGISTRY", {})
            if isinstance(name, str) and name.startswith(LOSS_PREFIX) and name not in registry:
                raise _stop(
                    f"loss_mode={name}",
                    "verl has no such loss mode",
                    "choose one of verl's loss modes",
                )
            return original(name, *args, **kwargs)

        return get_policy_loss_fn

    _wrap(module, LOSS_LOOKUP, make)


def install_guard(error: BaseException) -> None:
    """Record ``error`` (the entry point's import failure), log it once as a warning, and register the checks."""
    _STATE["error"] = " ".join(f"{type(error).__name__}: {error}".split())  # one line
    logger.warning(
        "nemo-is-plugin's verl entry point failed to load (%s): any nemo_is setting (impl_backend=%s, a %s* loss "
        "mode) will stop the run where verl reads it",
        _STATE["error"],
        BACKEND,
        LOSS_PREFIX,
    )
    when_imported(CONFIG_MODULE, "nemo_is.verl_guard.config", _on_config_module)
    when_imported(ENGINE_MODULE, "nemo_is.verl_guard.engine", _on_engine_module)
    when_imported(FSDP_PATCH_MODULE, "nemo_is.verl_guard.fsdp", _on_fsdp_patch_module)
    when_imported(LOSS_MODULE, "nemo_is.verl_guard.loss", _on_loss_module)


__all__ = ["PluginNotLoadedError", "install_guard"]
