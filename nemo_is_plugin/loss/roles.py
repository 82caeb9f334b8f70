"""Which log-probs play which part in the loss's per-token terms: the one record every host fills, and
:func:`~nemo_is_plugin.loss.terms.term_inputs` the one function that reads it.

The hosts name their log-probs differently (NeMo-RL's ``prev_logprobs`` / ``generation_logprobs``, verl's
``old_log_prob`` / ``rollout_log_probs``, slime's ``log_probs`` / ``rollout_log_probs``) and bind them to the loss's
roles by rules of their own; :class:`Roles` is where those rules end. Its roles:

- ``pi_old``: the policy ratio's denominator, chosen by :func:`pi_old_of` (one rule for every host).
- ``mu``: the sampler's log-probs (the rollout policy): what the IS correction divides by, what the KL's on-policy
  weight reads.
- ``is_prev``: log pi_prev, what the IS correction (weights, truncation, rejections, veto) compares with mu.
- ``mismatch_prev``: what the training-vs-rollout mismatch diagnostics compare with mu.
- ``corrects``: whether the plugin computes the IS correction at all; its rejections (weight 0) apply to the policy
  term only, the KL and the host's entropy term keep those tokens (``term_inputs``: one rule for every host).
- ``reference`` / ``kl`` / ``kl_coef``: the KL term: the reference log-probs, the estimator and which role weights it
  (:class:`~nemo_is_plugin.loss.kl.KLSpec`), its coefficient.

NeMo-RL's (and verl's, through the same ``LossInputs``) are :meth:`Roles.of_loss_inputs`; slime's are filled from its
batch in ``adapters/slime/roles.py``. Every tensor is detached and in the loss dtype; filling a record reads no value
back to the host.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from nemo_is_plugin.loss.aligned_inputs import LossInputs
from nemo_is_plugin.loss.input_validation import required_input
from nemo_is_plugin.loss.kl import KLSpec
from nemo_is_plugin.loss.layout import TokenLayout

if TYPE_CHECKING:
    from nemo_is_plugin.loss.config_model import ClippedPGLossConfig


@dataclass(frozen=True)
class Roles:
    """The batch's log-probs in the loss's roles (token tensors of one layout, detached, in the loss dtype).

    pi_old: the ratio's denominator (:func:`pi_old_of`). mu: the sampler's log-probs; None when the host has none (a
    slime batch without ``rollout_log_probs``): the batch is then taken as on-policy, mu = pi_old. is_prev /
    mismatch_prev: what the IS correction / the mismatch diagnostics compare with mu. corrects: the plugin computes
    the IS correction (else the host corrects, or nothing does). advantages, token_mask; valid: the tokens that count
    (token_mask times the sample's mask). reference / kl / kl_coef: the KL term (reference None: none). rewards: the
    samples' rewards ``[S]`` (the positive-sample NLL term reads them; None: no NLL term). sampler_head: the sampler's
    top-k head log-probs ``[*T, k]`` (score centering: ``ScoreCenteringHead.sampler_head``).
    """

    pi_old: torch.Tensor
    mu: torch.Tensor | None
    is_prev: torch.Tensor
    mismatch_prev: torch.Tensor
    corrects: bool
    advantages: torch.Tensor
    token_mask: torch.Tensor
    valid: torch.Tensor
    reference: torch.Tensor | None = None
    kl: KLSpec | None = None
    kl_coef: float = 0.0
    rewards: torch.Tensor | None = None
    sampler_head: torch.Tensor | None = None

    @classmethod
    def of_loss_inputs(
        cls, cfg: ClippedPGLossConfig, inputs: LossInputs, layout: TokenLayout, c: torch.Tensor
    ) -> Roles:
        """NeMo-RL's roles (and verl's, whose adapter builds the same ``LossInputs``): pi_old by :func:`pi_old_of`
        from ``prev_logprobs``; IS weights and mismatch metrics compare :func:`is_prev_of` with
        ``generation_logprobs``; the correction is always computed (its metrics are reported with IS off); the KL is
        the plugin's keys. ``c``: the current log-probs in the loss dtype."""
        dtype = c.dtype

        def as_f(t: torch.Tensor) -> torch.Tensor:
            return t.detach().to(dtype)

        tm, sm = inputs.token_mask.to(dtype), inputs.sample_mask.to(dtype)
        mu = as_f(inputs.generation_logprobs)
        p = pi_old_of(cfg, c, lambda: as_f(required_input(inputs.prev_logprobs, "prev_logprobs")), lambda: mu)
        prev = is_prev_of(cfg, c, p)
        beta = cfg.effective_kl_penalty
        reference = as_f(required_input(inputs.reference_logprobs, "reference_policy_logprobs")) if beta != 0 else None
        sampler_head = None
        if cfg.score_centering:
            head = required_input(inputs.head, "rollout_topk_logprobs")
            sampler_head = as_f(head.sampler_head)
        return cls(
            pi_old=p,
            mu=mu,
            is_prev=prev,
            mismatch_prev=prev,
            corrects=True,
            advantages=as_f(inputs.advantages),
            token_mask=tm,
            valid=tm * layout.to_tokens(sm),
            reference=reference,
            kl=KLSpec.of(cfg) if reference is not None else None,
            kl_coef=beta,
            rewards=inputs.rewards,
            sampler_head=sampler_head,
        )


def pi_old_of(
    cfg: ClippedPGLossConfig,
    c: torch.Tensor,
    logged: Callable[[], torch.Tensor],
    mu: Callable[[], torch.Tensor],
) -> torch.Tensor:
    """The ratio's denominator pi_old, every host's one rule: the current policy, detached, under
    an objective whose pi_old is the current policy (``on_policy``, which NeMo-RL's ``force_on_policy_ratio`` selects:
    the ratio is 1 with the policy gradient); mu in bypass mode (``old_policy_logprobs:
    generation``: verl's ``bypass_mode``, slime's ``--use-rollout-logprobs``); else the host's logged old policy.
    ``logged`` and ``mu`` are read only when chosen (a host without them raises its own error there)."""
    if cfg.objective.pi_old_is_current:
        return c.detach()
    if cfg.bypasses_prev:
        return mu()
    return logged()


def is_prev_of(cfg: ClippedPGLossConfig, c: torch.Tensor, pi_old: torch.Tensor) -> torch.Tensor:
    """NeMo-RL's and verl's log pi_prev, what the IS weights, rejections and mismatch diagnostics compare with mu:
    pi_old, or in bypass mode (pi_old = mu) the current policy, detached, as verl's bypass mode does."""
    return c.detach() if cfg.bypasses_prev else pi_old


__all__ = ["Roles", "is_prev_of", "pi_old_of"]
