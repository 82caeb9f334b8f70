"""NeMo-RL's loss interface (``nemo_rl/algorithms/loss/interfaces.py``), modelled with ``typing.Protocol``.

NeMo-RL is not on PyPI, so the plugin cannot import it in CI. What a NeMo-RL worker relies on is small:

- ``loss_fn.loss_type`` (:class:`LossType`): which global count the loss is divided by; the split API and the
  metric rescaling key on it;
- ``loss_fn.input_type`` (:class:`LossInputType`): LOGPROB -> the worker passes ``next_token_logprobs [B, S-1]``;
  LOGIT -> it passes the raw ``logits [B, S, V/TP]`` and the loss computes log-probs itself;
- optional ``metric_normalizations: dict[str, MetricNormalizer]``: per metric, the global count it was divided by,
  so a split-API trainer can undo its placeholder counts of 1; metrics not listed fall back to ``loss_type``'s count;
- optional ``reference_policy_kl_penalty`` (read by ``prepare_loss_input`` to decide on unfiltered log-probs) and
  ``use_fused_linear_logprobs``;
- ``__call__(data=, global_valid_seqs=, global_valid_toks=, next_token_logprobs= | logits=) -> (loss, metrics)``.

The enums must be *NeMo-RL's own* when NeMo-RL is importable: its workers compare ``loss_fn.input_type ==
LossInputType.LOGPROB`` with their enum, and two distinct Enum classes never compare equal. So the names below are
NeMo-RL's classes when ``nemo_rl`` imports, and look-alikes with the same members and values otherwise.
"""

from __future__ import annotations

import enum
from typing import Any, Protocol, TypeVar, cast, runtime_checkable


class _LossType(enum.Enum):
    TOKEN_LEVEL = "token_level"
    SEQUENCE_LEVEL = "sequence_level"


class _LossInputType(enum.Enum):
    LOGIT = "logit"
    LOGPROB = "logprob"
    DISTILLATION = "distillation"


class _MetricNormalizer(enum.Enum):
    TOKENS = "tokens"  # divided by global_valid_toks
    SEQUENCES = "sequences"  # divided by global_valid_seqs
    NONE = "none"  # raw counts, local means, min/max: never rescaled


_E = TypeVar("_E", bound=enum.Enum)


def _host_enum(name: str, fallback: type[_E]) -> type[_E]:
    # Newer NeMo-RL keeps the interface under algorithms/loss/, older releases directly under algorithms/.
    for module in ("nemo_rl.algorithms.loss.interfaces", "nemo_rl.algorithms.interfaces"):
        try:
            mod = __import__(module, fromlist=[name])
        except Exception:  # ImportError, or a broken NeMo-RL install: fall back to the look-alike
            continue
        found = getattr(mod, name, None)
        if isinstance(found, type) and issubclass(found, enum.Enum):
            # The look-alike mirrors NeMo-RL's enum member for member (names and values), so code typed against it
            # is right for NeMo-RL's.
            return cast("type[_E]", found)
    return fallback


LossType = _host_enum("LossType", _LossType)
LossInputType = _host_enum("LossInputType", _LossInputType)
MetricNormalizer = _host_enum("MetricNormalizer", _MetricNormalizer)
USING_HOST_ENUMS = LossType is not _LossType


@runtime_checkable
class LossFunction(Protocol):
    """What NeMo-RL's policy workers call. Keyword arguments depend on ``input_type`` (see the module docstring)."""

    loss_type: Any  # LossType
    input_type: Any  # LossInputType

    def __call__(
        self, data: Any, global_valid_seqs: Any, global_valid_toks: Any, **kwargs: Any
    ) -> tuple[Any, dict[str, Any]]: ...
