"""Score centering through the verl adapter: verl's key and batch-field names -> the plugin's, and verl's metrics.

verl (verl-project/verl PR #8010, ``verl/trainer/ppo/score_centering.py``) switches score centering on with
``rollout_correction.score_centering: true`` and records the sampler's head in the batch fields ``rollout_topk_ids``
(int32) and ``rollout_topk_log_probs`` (float32), ``k = actor_rollout_ref.rollout.topk_log_probs`` per token. Its
logits processor reduces the head to one per-token term (``sc_correction``) inside its own bypass-mode REINFORCE loss;
the plugin computes the term itself (``loss/score_centering.py``: f from the configured truncation, every objective
and IS setting it composes with), so it needs the head and the trainer's log-probs at the head ids, response-aligned
like ``log_prob``:

    policy_loss_fn(..., rollout_topk_ids=[B, T, k], rollout_topk_log_probs=[B, T, k], topk_log_probs=[B, T, k])

``topk_log_probs`` (the trainer's, with gradient) must come from the same log-softmax as ``log_prob``: verl's
``topk_log_probs_from_logits`` on the same logits, or ``nemo_is_plugin.loss.score_centering.label_and_head_logprobs``.
verl's ``ppo_loss`` passes none of them to a policy loss today (docs/verl.md, *Score centering*, has the upstream
change); a verl ``sc_correction`` handed to the plugin is refused rather than dropped or added twice.

verl's metrics of the term, under its names, are returned beside the plugin's ``score_centering_*``:
``actor/sc_correction`` (token mean of sum_H c_v log p_v, verl's ``compute_policy_loss_reinforce``),
``actor/sc_sampler_head_mass`` and ``actor/sc_train_head_mass`` (token means of the head masses Q_H and P_H, verl's
``ppo_loss``), over the tokens the term acts on. One difference: a -inf sampler slot is an empty slot here (no mass,
no gradient, its id in the modelled tail); verl keeps its id in the head with q = 0 (its trainer mass counts in P_H and
it gets c = -alpha p). docs/verl.md lists it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from nemo_is_plugin.adapters.verl.fields import VerlConfigError
from nemo_is_plugin.loss.score_centering import ScoreCenteringHead

HEAD_FIELDS = ("rollout_topk_ids", "rollout_topk_log_probs")  # verl's batch fields (the sampler's head)
TRAINER_HEAD = "topk_log_probs"  # the trainer's log-probs at the head ids (the counterpart of log_prob)
VERL_SC_METRICS = ("actor/sc_correction", "actor/sc_sampler_head_mass", "actor/sc_train_head_mass")


def head_inputs(score_centering: bool, extra: Mapping[str, Any]) -> ScoreCenteringHead | None:
    """The ``LossInputs`` head from a verl call's keyword arguments (verl's names; None with score centering off), or
    refusals.

    Raises ``VerlConfigError`` for verl's own ``sc_correction`` (its bypass loss's term: the plugin computes its own,
    so adding verl's would count the centring twice and dropping it would hide it) and for head tensors given without
    ``score_centering`` (they would be silently unused), and for a head tensor missing with it on (named as verl's
    argument).
    """
    if extra.get("sc_correction") is not None:
        raise VerlConfigError(
            "sc_correction is verl's own centring term (its bypass_mode REINFORCE loss): with the plugin's loss, set "
            "score_centering: true under policy_loss.nemo_is.rollout_correction and pass the head instead "
            f"({', '.join(HEAD_FIELDS)}, {TRAINER_HEAD}; docs/verl.md, Score centering)"
        )
    given = [k for k in (*HEAD_FIELDS, TRAINER_HEAD) if extra.get(k) is not None]
    if not score_centering:
        if given:
            raise VerlConfigError(
                f"{', '.join(given)} given but score centering is off: set rollout_correction.score_centering: true "
                "in policy_loss.nemo_is, or stop passing the head"
            )
        return None
    missing = [k for k in (*HEAD_FIELDS, TRAINER_HEAD) if k not in given]
    if missing:
        raise VerlConfigError(
            f"score centering is on but the policy loss got no {', '.join(missing)}: pass verl's head fields and the "
            f"trainer's log-probs at them ({TRAINER_HEAD}, [B, T, k]; docs/verl.md, Score centering), or set "
            "rollout_correction.score_centering: false"
        )
    return ScoreCenteringHead(extra[HEAD_FIELDS[0]], extra[HEAD_FIELDS[1]], extra[TRAINER_HEAD])


def verl_centering_statistics(terms: Any, trainer_head: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """verl's score-centering metrics as device tensors (read in the loss's one host sync); empty without the term.

    ``terms``: the loss's ``LossTerms``; ``trainer_head``: the trainer's head log-probs it was given.
    """
    sc = getattr(terms.tokens, "centering", None)
    if sc is None or trainer_head is None:
        return {}
    with torch.no_grad():
        mask = sc.counted.to(sc.coef.dtype)
        n = mask.sum() + 1e-8  # verl's masked_mean
        lp = torch.where(sc.filled, trainer_head.detach().to(sc.coef.dtype), torch.zeros_like(sc.coef))
        correction = (sc.coef * lp).sum(-1)
        return {
            "actor/sc_correction": (correction * mask).sum() / n,
            "actor/sc_sampler_head_mass": ((1 - sc.sampler_tail) * mask).sum() / n,
            "actor/sc_train_head_mass": ((1 - sc.trainer_tail) * mask).sum() / n,
        }


__all__ = ["HEAD_FIELDS", "TRAINER_HEAD", "VERL_SC_METRICS", "head_inputs", "verl_centering_statistics"]
