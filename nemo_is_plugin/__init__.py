"""nemo-is-plugin: policy-gradient losses with independent, validated importance-sampling corrections.

Public API: ``build_loss_fn(loss_fn_section)`` builds the loss the section names (the registry's default,
``nemo_is.clipped_pg``, is called exactly like NeMo-RL's ClippedPGLossFn).
"""

from nemo_is_plugin.config import ClippedPGLossConfig, ConfigError
from nemo_is_plugin.loss import ClippedPGLoss, LossInputs, build_loss_fn
from nemo_is_plugin.loss.layout import TokenLayout
from nemo_is_plugin.loss.mismatch_metrics import finalize_metrics

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
