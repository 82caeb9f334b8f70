"""slime's batch in the loss's roles (:class:`~nemo_is_plugin.loss.roles.Roles`), as slime's own
``policy_loss_function`` binds them (THUDM/slime 624b824a, ``slime/backends/megatron_utils/loss.py``).

Where slime's rule is the loss's, the record says so by using the loss's: pi_old is :func:`pi_old_of` (slime's
``log_probs``, or the current policy detached when the batch has none: on-policy training; the rollout log-probs
under ``--use-rollout-logprobs``). Where slime's own rule differs from NeMo-RL's it is a field, filled here:

- ``is_prev``: slime's TIS compares ``train_log_probs`` = the batch's ``log_probs`` (the current policy, detached,
  without them) with the rollout log-probs, also under ``--use-rollout-logprobs`` (where slime recomputes
  ``log_probs`` for ``--get-mismatch-metrics``), not the current policy as NeMo-RL's and verl's bypass mode do.
- ``mismatch_prev``: slime's ``train_rollout_logprob_abs_diff`` compares the current policy with the rollout
  log-probs under ``--use-rollout-logprobs``, and its ``old_log_probs`` otherwise.
- ``corrects``: the plugin corrects only when its keys ask for it (:func:`~nemo_is_plugin.adapters.shared.
  owns_correction`); NeMo-RL's loss always computes the correction (its metrics report it with IS off).
- ``valid`` is slime's ``loss_masks``: slime has no sample mask, a removed sample's loss mask is already zero.
- ``mu`` is None without ``rollout_log_probs`` (no sampler log-probs: the batch is on-policy, mu = pi_old).
- the KL is slime's ``--use-kl-loss`` term (its estimator; ``--use-unbiased-kl`` weights it by exp(c - pi_old)), or
  the plugin's KL keys.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from nemo_is_plugin.adapters.shared import owns_correction
from nemo_is_plugin.adapters.slime.layout import ResponseShard
from nemo_is_plugin.loss.config_model import ClippedPGLossConfig
from nemo_is_plugin.loss.kl import KLSpec, KLWeight
from nemo_is_plugin.loss.roles import Roles, pi_old_of


def batch_tokens(name: str, batch: Mapping[str, Any], shard: ResponseShard, c: torch.Tensor) -> torch.Tensor | None:
    """This rank's tokens of ``batch[name]`` (per-sample lists), detached, in ``c``'s dtype; None when the batch has
    none."""
    values = batch.get(name)
    return None if not values else shard.check_local(name, values).detach().to(c.dtype)


def slime_roles(
    cfg: ClippedPGLossConfig,
    kl: Mapping[str, Any] | None,
    batch: Mapping[str, Any],
    shard: ResponseShard,
    c: torch.Tensor,
    *,
    sampler_head: torch.Tensor | None = None,
) -> Roles:
    """slime's batch in the loss's roles (the module docstring). ``kl``: slime's ``--use-kl-loss`` term
    (``config.slime_kl``), None when off. ``sampler_head``: the sampler's head log-probs ``[N, k]``, read with
    ``score_centering``."""
    tm = shard.local(batch["loss_masks"]).to(c.dtype)
    rollout = batch_tokens("rollout_log_probs", batch, shard, c)
    logged = batch_tokens("log_probs", batch, shard, c)
    old = c.detach() if logged is None else logged

    def rollout_for_bypass() -> torch.Tensor:
        if rollout is None:
            raise ValueError("--use-rollout-logprobs (old_policy_logprobs: generation) needs rollout_log_probs")
        return rollout

    p = pi_old_of(cfg, c, lambda: old, rollout_for_bypass)
    corrects = owns_correction(cfg)
    if corrects and rollout is None:
        raise ValueError("the IS correction needs rollout_log_probs in slime's batch (SGLang log-probs)")
    ref, spec, coef = None, None, 0.0
    if kl is not None or cfg.effective_kl_penalty != 0:
        ref = batch_tokens("ref_log_probs", batch, shard, c)
        if ref is None:
            raise ValueError("the KL term needs ref_log_probs in slime's batch (slime loads the reference model)")
        if kl is None:
            spec, coef = KLSpec.of(cfg), cfg.effective_kl_penalty
        else:  # slime's unbiased KL: its gradient through the ratio to pi_old
            weight: KLWeight = "anchor" if kl["unbiased"] else "none"
            spec, coef = KLSpec(kl["kl_type"], output_clamp=kl["output_clamp"], weight=weight), kl["coef"]
    if cfg.score_centering and sampler_head is None:
        raise ValueError("score_centering: slime_roles needs sampler_head (slime's rollout_topk_log_probs)")
    return Roles(
        pi_old=p,
        mu=rollout,
        is_prev=old,
        mismatch_prev=c.detach() if cfg.bypasses_prev else old,
        corrects=corrects,
        advantages=shard.check_local("advantages", batch["advantages"]).detach().to(c.dtype),
        token_mask=tm,
        valid=tm,
        reference=ref,
        kl=spec,
        kl_coef=coef,
        sampler_head=sampler_head.detach().to(c.dtype) if cfg.score_centering and sampler_head is not None else None,
    )


__all__ = ["batch_tokens", "slime_roles"]
