"""Score centering in slime's full loss: the sampler's top-k head from slime's batch.

Upstream slime (THUDM/slime 2e5cd7cd, ``slime/utils/score_centering.py`` and ``slime/backends/megatron_utils/loss.py``)
records the head with ``--use-score-centering`` / ``--score-centering-top-k k`` as two sample fields that reach the
loss's batch as per-sample lists, CP-local like ``log_probs`` (this rank's response rows of each sample):

- ``rollout_topk_token_ids``: int32 ``[R_i, k]``, SGLang's top-k token ids of each response token;
- ``rollout_topk_log_probs``: float32 ``[R_i, k]``, SGLang's full-vocabulary log-probs at them.

The trainer's log-probs at the same ids come from the plugin's vocab-parallel kernel in the same pass (and the same
log-sum-exp) as the label's (:func:`~nemo_is_plugin.adapters.slime.entry_points.response_logprobs`), never from a
second log-softmax.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from nemo_is_plugin.adapters.slime.layout import ResponseShard
from nemo_is_plugin.loss.input_values import POSITIVE_LOGPROB_TOLERANCE
from nemo_is_plugin.loss.score_centering import ScoreCenteringHead, check_head_shapes, check_head_values
from nemo_is_plugin.loss.terms import TermInputs

HEAD_KEYS = ("rollout_topk_token_ids", "rollout_topk_log_probs")  # upstream slime's sample fields


def slime_head(batch: Mapping[str, Any], shard: ResponseShard, top_k: int | None) -> ScoreCenteringHead:
    """This rank's head ids (long ``[N, k]``) and sampler log-probs (``[N, k]``) from slime's batch (the trainer's
    log-probs at them come later, from the label's pass); a missing key raises naming it."""
    got = []
    for name in HEAD_KEYS:
        values = batch.get(name)
        if values is None:
            raise KeyError(
                f"score_centering: slime's batch has no '{name}' (the sampler's top-k head: upstream slime's "
                "--use-score-centering records it); record the head or turn score centering off"
            )
        got.append(shard.check_local_rows(name, values))
    head_ids, sampler_head = got
    token_shape = (head_ids.shape[0],)  # the sampler's log-probs stand in for the trainer's, not computed yet
    names = (HEAD_KEYS[0], HEAD_KEYS[1], HEAD_KEYS[1])
    check_head_shapes(token_shape, top_k, head_ids, sampler_head, sampler_head, names=names)
    return ScoreCenteringHead(head_ids.to(device=shard.device, dtype=torch.long), sampler_head.to(shard.device))


def check_slime_head(t: TermInputs, trainer_head: torch.Tensor) -> None:
    """Refuse, in one host read, head values the term cannot use on the tokens it acts on (the loss's rule)."""
    assert t.sampler_head is not None
    counted = (t.valid != 0) & torch.isfinite(t.mu)
    tolerance = POSITIVE_LOGPROB_TOLERANCE.get(t.sampler_head.dtype, 1e-4)
    names = (HEAD_KEYS[1], "the trainer's head log-probs")
    check_head_values(counted, t.sampler_head, trainer_head, names, tolerance)


__all__ = ["HEAD_KEYS", "check_slime_head", "slime_head"]
