"""nemo-is-plugin: policy-gradient losses with independent, validated importance-sampling corrections.

Public API: ``build_loss_fn(loss_fn_section)`` builds the loss the section names (the registry's default,
``nemo_is.clipped_pg``, is called exactly like NeMo-RL's ClippedPGLossFn).

Importing the package imports the standard library alone (no torch, no pydantic): ``ConfigError`` and the loss's names
(and the assembled config, built from the objective modules) load on first use (PEP 562 ``__getattr__``), so a
config-only tool (``nemo-is validate`` of a schema error, an adapter's start-up hook) pays for torch only when it builds
a loss, and verl's entry point (``adapters/verl/plugin.py``) reaches its own ``try`` before any third-party import.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from nemo_is_plugin.config.errors import ConfigError
    from nemo_is_plugin.loss import ClippedPGLoss, LossInputs, build_loss_fn
    from nemo_is_plugin.loss.config_model import ClippedPGLossConfig
    from nemo_is_plugin.loss.layout import TokenLayout
    from nemo_is_plugin.loss.mismatch_metrics import finalize_metrics

_LAZY = frozenset(
    {"ClippedPGLoss", "ClippedPGLossConfig", "LossInputs", "TokenLayout", "build_loss_fn", "finalize_metrics"}
)


def __getattr__(name: str) -> Any:
    if name == "ConfigError":  # pydantic's module: loaded on use too (verl's entry point imports only the stdlib first)
        from nemo_is_plugin.config.errors import ConfigError

        return ConfigError
    if name in _LAZY:
        from nemo_is_plugin import loss
        from nemo_is_plugin.loss import config_model, layout, mismatch_metrics

        source = {"ClippedPGLossConfig": config_model, "TokenLayout": layout, "finalize_metrics": mismatch_metrics}
        value = getattr(source.get(name, loss), name)
        globals()[name] = value  # later look-ups skip this hook
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "ClippedPGLoss",
    "ClippedPGLossConfig",
    "ConfigError",
    "LossInputs",
    "TokenLayout",
    "build_loss_fn",
    "finalize_metrics",
]
__version__ = "0.1.0"
