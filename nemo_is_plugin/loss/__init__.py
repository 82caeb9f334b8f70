"""The policy-gradient loss and its math: pure torch on token tensors, no communication, no global state.

:class:`ClippedPGLoss` (``clipped_pg``) composes the pieces a :class:`~nemo_is_plugin.config.ClippedPGLossConfig`
chooses: ``ratios`` (policy ratio levels), ``surrogate`` (clipped surrogates), ``is_weights`` / ``truncation`` /
``rejection`` / ``correction`` (the IS correction), ``kl`` (the KL penalty), ``aggregation`` (token / sequence means),
``metrics`` / ``mismatch_metrics`` (the metrics), ``input_validation`` (the input checks); ``layout`` (TokenLayout:
which sequence and position each token is) and ``masked`` underlie them. ``separable`` gives the loss's per-token
gradient chunk by chunk (the fused single pass). ``registry`` resolves loss names;
its ``build_loss_fn`` builds the loss a ``loss_fn`` section names.
"""

from nemo_is_plugin.loss.clipped_pg import ClippedPGLoss, LossInputs
from nemo_is_plugin.loss.registry import build_loss_fn

__all__ = ["ClippedPGLoss", "LossInputs", "build_loss_fn"]
