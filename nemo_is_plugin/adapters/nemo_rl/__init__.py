"""NeMo-RL (NVIDIA-NeMo/RL): the plugin's loss as NeMo-RL's ``LossFunction``, and its LM head in NeMo-RL's fused path.

- ``loss_fn``: :class:`NeMoRLLossFn` (alias ``ClippedPGLossFn``: ``from nemo_is_plugin.adapters.nemo_rl import
  ClippedPGLossFn`` is the whole swap in ``grpo.setup``), :func:`build_nemo_rl_loss_fn` (from a master config),
  :func:`dump_rollouts` (the rollout-dump hook of ``grpo_train``), ``loss_type_of``;
- ``protocol``: NeMo-RL's ``LossFunction`` as a ``typing.Protocol`` and its enums (NeMo-RL's own when it imports);
- ``head``: ``from_parallel_hidden_states_to_logprobs`` on the plugin's head and its patch, switched on by
  ``NEMO_IS_NEMO_RL_HEAD=1``; ``startup``: the ``sitecustomize`` start-up hook that applies it in NeMo-RL's workers.

The names of ``loss_fn`` are imported on first use: the start-up hook imports ``head`` while NeMo-RL imports its
``nemo_rl.distributed.model_utils``, and must not import NeMo-RL's loss interfaces (``protocol``) in the middle of
that import.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from nemo_is_plugin.adapters.nemo_rl.loss_fn import (
        NEMO_RL_CONFIG_ATTRIBUTES,
        ClippedPGLossFn,
        NeMoRLLossFn,
        build_nemo_rl_loss_fn,
        dump_rollouts,
        loss_type_of,
    )
    from nemo_is_plugin.adapters.shared import PARALLEL_STATE

_LOSS_FN_NAMES = (
    "NEMO_RL_CONFIG_ATTRIBUTES",
    "ClippedPGLossFn",
    "NeMoRLLossFn",
    "build_nemo_rl_loss_fn",
    "dump_rollouts",
    "loss_type_of",
)


def __getattr__(name: str) -> Any:
    # only these names: ``from nemo_is_plugin.adapters.nemo_rl import head`` asks for ``head`` here first, and must
    # get an AttributeError (then the submodule), not an import of loss_fn
    if name in _LOSS_FN_NAMES:
        from nemo_is_plugin.adapters.nemo_rl import loss_fn

        return getattr(loss_fn, name)
    if name == "PARALLEL_STATE":
        from nemo_is_plugin.adapters.shared import PARALLEL_STATE

        return PARALLEL_STATE
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "NEMO_RL_CONFIG_ATTRIBUTES",
    "PARALLEL_STATE",
    "ClippedPGLossFn",
    "NeMoRLLossFn",
    "build_nemo_rl_loss_fn",
    "dump_rollouts",
    "loss_type_of",
]
