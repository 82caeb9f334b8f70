"""The policy-gradient loss and its math: pure torch on token tensors, no communication, no global state.

:class:`ClippedPGLoss` (``clipped_pg``) reduces and reports the per-token terms that ``terms`` computes once per call
(one typed :class:`~nemo_is_plugin.loss.terms.LossTerms`): the policy objective's surrogate (``objectives``: one
module per ``policy_objective``, PPO's clip among them, with ``ratios``), the IS correction (``is_weights`` /
``truncation`` / ``rejection`` / ``correction``), the KL penalty (``kl``), score centering's term
(``score_centering``); ``aggregation`` reduces them, ``metrics`` / ``mismatch_metrics`` report them (each with its
``denominator``), ``input_validation`` / ``input_values`` check the inputs; ``layout`` (TokenLayout: which sequence and
position each token is) and ``masked`` underlie them. ``separable`` gives the loss's per-token gradient chunk by chunk
(the fused single pass) from the same terms. ``registry`` resolves loss names; its ``build_loss_fn`` builds the loss a
``loss_fn`` section names.

The names below are imported on first use: ``ClippedPGLossConfig`` imports the objective modules of this package to
build its keys, so this package's ``__init__`` must not import the loss (which imports the config) first.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from nemo_is_plugin.loss.clipped_pg import ClippedPGLoss, LossInputs
    from nemo_is_plugin.loss.registry import build_loss_fn


def __getattr__(name: str) -> Any:
    if name in ("ClippedPGLoss", "LossInputs"):
        from nemo_is_plugin.loss import clipped_pg

        return getattr(clipped_pg, name)
    if name == "build_loss_fn":
        from nemo_is_plugin.loss.registry import build_loss_fn

        return build_loss_fn
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["ClippedPGLoss", "LossInputs", "build_loss_fn"]
