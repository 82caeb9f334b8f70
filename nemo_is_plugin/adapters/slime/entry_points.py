"""The plugin's loss in slime (THUDM/slime, commit 624b824a), enabled from slime's command line: no source edit.

Two entry points, each a module attribute slime loads by path (``slime.utils.misc.load_function``):

- the full policy loss, :data:`policy_loss`::

      --loss-type custom_loss --custom-loss-function-path nemo_is_plugin.adapters.slime.policy_loss

  slime's ``loss_function`` calls ``policy_loss(args, batch, logits, sum_of_sample_mean)`` with this rank's logits
  ``[1, T, V/TP]`` and expects ``(loss, {name: 0-d tensor})``; it then rescales the loss for Megatron's gradient
  accumulation itself. The response log-probs (and the entropy) come from the plugin's vocab-parallel kernel on the
  response rows of slime's CP-sharded logits (:mod:`~nemo_is_plugin.adapters.slime.layout`); every per-token term
  is reduced with slime's ``sum_of_sample_mean``, so slime's rescaling stays right. The per-token terms are the
  plugin's, computed by the loss's own :func:`~nemo_is_plugin.loss.terms.token_terms` on the constants of slime's
  roles (:func:`slime_term_inputs`: :mod:`~nemo_is_plugin.adapters.slime.roles`, then the loss's ``term_inputs``):
  any policy objective (PPO's clip at any ratio level, in ratio or log space, CISPO, or another
  ``policy_objective``), its IS correction (any level, truncation, rejection rules, veto), a KL term (slime's
  ``--use-kl-loss`` estimators, or the plugin's KL keys), and score centering on the sampler's head in slime's batch
  (:mod:`~nemo_is_plugin.adapters.slime.centering`; the trainer's head log-probs from the label's kernel call);
  slime's reducer replaces the plugin's aggregation, and the metrics (:func:`slime_metrics`) read the same terms.

- the IS correction alone, :data:`tis_function`, inside slime's own PPO loss::

      --use-tis --custom-tis-function-path nemo_is_plugin.adapters.slime.tis_function

  slime calls ``tis_function(args=, pg_loss=, train_log_probs=, rollout_log_probs=, loss_masks=, total_lengths=,
  response_lengths=)`` with the per-token ``pg_loss`` and this CP rank's log-probs, and expects ``(pg_loss,
  modified_response_masks, metrics)``. The plugin's IS levels (token, sequence, sequence_mean, cumulative) and
  truncation / rejection rules apply; sequence sums and cumulative prefixes span the CP ranks.

Configuration: slime's flags are mapped or refused by :mod:`~nemo_is_plugin.adapters.slime.config`; the plugin's keys
come from ``args.nemo_is`` (slime's ``--custom-config-path`` YAML) and / or ``$NEMO_IS_CONFIG``; both are read and
validated at the first call and cached per setting. With no plugin keys (``nemo_is: {}``) the full loss is slime's
``policy_loss_function`` and the TIS function slime's ``vanilla_tis_function`` (``icepop_function`` with
``truncated_importance_sampling_type: icepop``). The process groups are megatron-core's (slime's ``mpu``), read in the
worker at every call, so that a process that rebuilds them (tests, notebooks, restarts) gets the new ones.

Masks under rejection: slime rebuilds its reducer with the returned masks (same denominators), so rejected tokens
leave the numerators. The TIS function zeroes this rank's rejected positions in the masks it returns (positions held
by other CP ranks are left as given: slime reads each rank's own slice only); IcePop's zeros stay weights, as in
slime's ``icepop_function``. The full loss zeroes the policy-gradient term of rejected tokens; the KL and entropy
terms keep them (the plugin's rule).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from nemo_is_plugin.adapters.shared import PARALLEL_STATE, GroupsSpec, check_groups, given_keys, resolve_groups
from nemo_is_plugin.adapters.slime.centering import check_slime_head, slime_head
from nemo_is_plugin.adapters.slime.config import (
    CONFIG_ARGS,
    CONFIG_ENV,
    SECTION_ENV,
    args_signature,
    plugin_keys,
    policy_config,
    slime_kl,
    tis_config,
)
from nemo_is_plugin.adapters.slime.layout import ResponseShard
from nemo_is_plugin.adapters.slime.metrics import centering_metrics, objective_metrics
from nemo_is_plugin.adapters.slime.roles import batch_tokens, slime_roles
from nemo_is_plugin.config import REJECTION_TYPES
from nemo_is_plugin.distributed.head.vocab_parallel import vocab_parallel_logprobs
from nemo_is_plugin.distributed.parallel.data_parallel import with_data_parallel
from nemo_is_plugin.distributed.parallel.groups import ParallelGroups, ProcessGroup
from nemo_is_plugin.loss import ClippedPGLoss
from nemo_is_plugin.loss.config_model import ClippedPGLossConfig
from nemo_is_plugin.loss.correction import ISCorrection, compute_is_correction
from nemo_is_plugin.loss.roles import Roles
from nemo_is_plugin.loss.terms import TermInputs, TokenTerms, is_correction_kwargs, term_inputs, token_terms

PLUGIN_PREFIX = "nemo_is/"
Reducer = Callable[[torch.Tensor], torch.Tensor]
ConfigSource = None | str | os.PathLike[str] | Mapping[str, Any] | ClippedPGLossConfig


def is_metrics(corr: ISCorrection) -> dict[str, torch.Tensor]:
    """Per-token IS metrics: slime's ``tis`` / ``tis_clipfrac`` / ``tis_abs`` (raw weight, weight changed or
    zeroed, |raw - 1|), the plugin's final weight and rejected fraction, and per rejection rule its statistic and
    rejected fraction. slime reduces them itself."""
    raw = corr.raw_weights
    out = {
        "tis": raw,
        "tis_clipfrac": (corr.out_of_band | corr.rejected).to(raw.dtype),
        "tis_abs": (raw - 1).abs(),
        PLUGIN_PREFIX + "is_weight": corr.weights,
        PLUGIN_PREFIX + "is_rejected_fraction": corr.rejected.to(raw.dtype),
    }
    # per rejection rule (the loss's names): its statistic (a sequence's value on each of its tokens) and the tokens it
    # rejects, then the tokens all rules together reject
    for rule in corr.rules:
        out[f"{PLUGIN_PREFIX}is_rejection_{rule.name}_mean"] = rule.token_stat.to(raw.dtype)
        out[f"{PLUGIN_PREFIX}is_rejection_{rule.name}_rejected_fraction"] = (~rule.keep).to(raw.dtype)
    if corr.rules_keep is not None:
        out[PLUGIN_PREFIX + "is_rejection_rejected_fraction"] = (~corr.rules_keep).to(raw.dtype)
    return out


def _masks_reject(cfg: ClippedPGLossConfig) -> bool:
    """Whether rejections leave slime's masks: sequence masks, rejection rules, the veto (not IcePop's zeros)."""
    return (
        cfg.truncated_importance_sampling_type in ("seq-mask-tis", *REJECTION_TYPES)
        or bool(cfg.rejection_rules)
        or cfg.importance_sampling_veto_threshold is not None
    )


class _SlimeEntry:
    """Config reading and group lookup shared by the two entry points."""

    name = "nemo_is"

    def __init__(self, config: ConfigSource = None, *, groups: GroupsSpec = PARALLEL_STATE):
        check_groups(groups, allow_none=False)
        self._source, self._groups_spec = config, groups
        self._configs: dict[tuple, Any] = {}

    def groups(self) -> ParallelGroups:
        """The explicit groups, else megatron-core's ``parallel_state`` (slime's ``mpu``) as it is now, read at every
        call (:func:`~nemo_is_plugin.adapters.shared.resolve_groups`)."""
        return resolve_groups(self._groups_spec)

    def user_keys(self, args: Any) -> dict[str, Any]:
        if isinstance(self._source, ClippedPGLossConfig):
            return given_keys(self._source)
        if self._source is not None:
            from nemo_is_plugin.adapters.recipes import to_loss_mapping

            keys = to_loss_mapping(self._source)
            keys.pop("name", None)
            return keys
        return plugin_keys(args, self.name)

    def settings(self, args: Any) -> Any:
        """The validated settings for these flags, built (and checked) at the first call with them."""
        key = (args_signature(args, CONFIG_ARGS), os.environ.get(CONFIG_ENV), os.environ.get(SECTION_ENV))
        if key not in self._configs:
            self._configs[key] = self.build(args, self.user_keys(args))
        return self._configs[key]

    def build(self, args: Any, user: Mapping[str, Any]) -> Any:
        raise NotImplementedError


class SlimeISCorrection(_SlimeEntry):
    """slime's custom TIS function (``--custom-tis-function-path``) computing the plugin's IS correction.

    Args:
        config: plugin keys bound here (a mapping, a recipe path or a ``ClippedPGLossConfig``) instead of
            ``args.nemo_is`` / ``$NEMO_IS_CONFIG``; only IS keys are accepted.
        groups: ``"parallel_state"`` (megatron-core's groups, read in the worker) or explicit ``ParallelGroups``.
    """

    name = "nemo_is_plugin.adapters.slime.tis_function"

    def build(self, args: Any, user: Mapping[str, Any]) -> ClippedPGLossConfig:
        return tis_config(args, user)

    def __call__(
        self,
        args: Any,
        *,
        pg_loss: torch.Tensor,
        train_log_probs: Sequence[torch.Tensor],
        rollout_log_probs: Sequence[torch.Tensor],
        loss_masks: Sequence[torch.Tensor],
        total_lengths: Sequence[int],
        response_lengths: Sequence[int],
        **_: Any,
    ) -> tuple[torch.Tensor, list[torch.Tensor], dict[str, torch.Tensor]]:
        cfg = self.settings(args)
        shard = ResponseShard(total_lengths, response_lengths, self.groups().cp, pg_loss.device)
        prev = shard.check_local("train_log_probs", train_log_probs).detach()
        gen = shard.check_local("rollout_log_probs", rollout_log_probs).detach().to(prev.dtype)
        tm = shard.local(loss_masks).to(prev.dtype)
        corr = compute_is_correction(prev, gen, tm, tm, shard.layout(), **is_correction_kwargs(cfg))
        weighted = pg_loss * corr.weights.to(pg_loss.dtype)
        out = torch.where(corr.rejected, torch.zeros_like(weighted), weighted)
        masks = list(loss_masks)
        if _masks_reject(cfg):
            masks = shard.scatter_local(loss_masks, tm * (~corr.rejected).to(tm.dtype))
        return out, masks, is_metrics(corr)


class SlimePolicyLoss(_SlimeEntry):
    """slime's custom loss (``--custom-loss-function-path``): the plugin's policy loss on slime's batch.

    Args: as :class:`SlimeISCorrection` (any plugin key but the aggregation ones).
    """

    name = "nemo_is_plugin.adapters.slime.policy_loss"

    def build(self, args: Any, user: Mapping[str, Any]) -> tuple[ClippedPGLoss, dict[str, Any] | None]:
        return ClippedPGLoss(policy_config(args, user)), slime_kl(args)

    def __call__(
        self, args: Any, batch: Mapping[str, Any], logits: torch.Tensor, sum_of_sample_mean: Reducer
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        loss_fn, kl = self.settings(args)
        cfg, groups = loss_fn.config, self.groups()
        shard = ResponseShard(batch["total_lengths"], batch["response_lengths"], groups.cp, logits.device)
        head = trainer_head = None
        if cfg.score_centering:  # the sampler's head, and the trainer's log-probs at it from the label's pass
            head = slime_head(batch, shard, cfg.score_centering_top_k)
        head_ids = None if head is None else head.head_ids
        got = response_logprobs(
            args, logits, batch["unconcat_tokens"], batch["total_lengths"], shard, groups, head_ids=head_ids
        )
        c, entropy = got[0], got[1]
        sampler_head = None if head is None else head.sampler_head
        t, roles = slime_term_inputs(cfg, kl, batch, shard, c, groups.dp, sampler_head=sampler_head)
        if head is not None:
            trainer_head = got[2]
            check_slime_head(t, trainer_head)
        terms = token_terms(t, c, trainer_head=trainer_head)
        pg_loss = sum_of_sample_mean(terms.actor)  # rejected tokens' IS weight is 0: they leave the policy term
        sc_loss = None
        if terms.centering is not None:  # reduced as the policy term, and part of it (as upstream slime's pg_loss)
            sc_loss = sum_of_sample_mean(terms.centering.term)
            pg_loss = pg_loss + sc_loss
        entropy_loss = sum_of_sample_mean(entropy)
        loss = pg_loss - float(getattr(args, "entropy_coef", 0.0) or 0.0) * entropy_loss
        kl_loss = None if terms.kl is None else sum_of_sample_mean(terms.kl)
        if kl_loss is not None:
            loss = loss + t.kl_coef * kl_loss
        if c.numel() == 0:  # keep the graph connected on a rank without response tokens (as slime does)
            loss = loss + 0 * logits.sum()
        metrics = slime_metrics(t, terms, sum_of_sample_mean, c, roles, batch, shard)
        if sc_loss is not None and terms.centering is not None and trainer_head is not None:
            sc = terms.centering
            metrics.update(centering_metrics(t, sc, sc_loss, c, trainer_head, sum_of_sample_mean, PLUGIN_PREFIX))
        metrics.update(loss=loss, pg_loss=pg_loss, entropy_loss=entropy_loss)
        if kl_loss is not None:
            metrics["kl_loss"] = kl_loss
        return loss, {k: torch.as_tensor(v).detach().clone() for k, v in metrics.items()}


def slime_term_inputs(
    cfg: ClippedPGLossConfig,
    kl: Mapping[str, Any] | None,
    batch: Mapping[str, Any],
    shard: ResponseShard,
    c: torch.Tensor,
    dp_group: ProcessGroup | None = None,
    *,
    sampler_head: torch.Tensor | None = None,
) -> tuple[TermInputs, Roles]:
    """The loss's batch constants from slime's batch in the loss's roles (:func:`~nemo_is_plugin.adapters.slime.
    roles.slime_roles`, turned into constants by the loss's own :func:`~nemo_is_plugin.loss.terms.term_inputs`), and
    the roles (the metrics read them). Batch statistics (an objective's) span the CP ranks and ``dp_group``."""
    roles = slime_roles(cfg, kl, batch, shard, c, sampler_head=sampler_head)
    return term_inputs(cfg, roles, with_data_parallel(shard.layout(), dp_group)), roles


def slime_metrics(
    t: TermInputs,
    terms: TokenTerms,
    reduce: Reducer,
    c: torch.Tensor,
    roles: Roles,
    batch: Mapping[str, Any],
    shard: ResponseShard,
) -> dict[str, torch.Tensor]:
    """slime's metric names where slime has the quantity, ``nemo_is/...`` otherwise, from the loss's terms and roles,
    and the objective's own (:mod:`~nemo_is_plugin.adapters.slime.metrics`); reduced with slime's
    ``sum_of_sample_mean``."""
    cfg, sur, corr = t.config, terms.surrogate, t.correction
    with torch.no_grad():
        # slime's ppo_kl: log pi_old - log pi per token; minus the log of the objective's ratio where that is not a
        # token's own (a sequence ratio level: GSPO's, as slime's GSPO reports it)
        sequence_ratio = sur.ratio if cfg.effective_ratio_level != "token" else None
        ppo_kl = t.pi_old - c.detach() if sequence_ratio is None else -torch.log(sequence_ratio)
        out = {} if sur.clipped is None else {"pg_clipfrac": reduce(sur.clipped.to(c.dtype))}
        out["ppo_kl"] = reduce(ppo_kl)
        for name, flag in (("low", sur.clipped_low), ("high", sur.clipped_high), ("dual", sur.dual_clipped)):
            if flag is not None:  # the clip indicators the objective has
                out[f"{PLUGIN_PREFIX}clip_fraction_{name}"] = reduce(flag.to(c.dtype))
        if roles.mu is not None:
            out["train_rollout_logprob_abs_diff"] = reduce((roles.mismatch_prev - roles.mu).abs())
        if corr is not None:
            out["ois"] = reduce(torch.exp(-ppo_kl))
            out.update({k: reduce(v.to(c.dtype)) for k, v in is_metrics(corr).items()})
        opd = batch_tokens("opd_reverse_kl", batch, shard, c)
        if opd is not None:
            out["opd_reverse_kl"] = reduce(opd)
    out.update(objective_metrics(cfg.objective, terms.objective, t.layout, t.valid, reduce, PLUGIN_PREFIX))
    return out


def response_logprobs(
    args: Any,
    logits: torch.Tensor,
    tokens: Sequence[torch.Tensor],
    total_lengths: Sequence[int],
    shard: ResponseShard,
    groups: ParallelGroups,
    *,
    head_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    """This rank's response log-probs and entropies ([N] each) from slime's ``logits [1, T, V/TP]``, and with
    ``head_ids`` (long ``[N, k]``) the log-probs at them (``[N, k]``) from the same log-sum-exp as the label's.

    Only the response rows are gathered; the logits are divided by ``--rollout-temperature`` first, as slime does.
    """
    if logits.dim() != 3 or logits.shape[0] != 1:
        raise ValueError(f"slime's logits are [1, T, V/TP], got {tuple(logits.shape)}")
    x = logits[0]
    temperature = float(getattr(args, "rollout_temperature", 1.0) or 1.0)
    rows = x.index_select(0, shard.logit_rows())
    if temperature != 1.0:
        rows = rows / temperature
    starts, offset = [], 0
    for total, response in zip(total_lengths, shard.response_lengths, strict=True):
        starts.append(offset + int(total) - response)
        offset += int(total)
    flat = torch.cat([t.reshape(-1) for t in tokens]).to(device=x.device, dtype=torch.long)
    target = flat.index_select(0, shard.target_index(starts))
    chunk = int(getattr(args, "log_probs_chunk_size", -1) or -1)
    return vocab_parallel_logprobs(
        rows, target, groups.tp, chunk_size=chunk if chunk > 0 else None, with_entropy=True, head_ids=head_ids
    )


# The objects slime loads by path (module attributes: nothing to pickle, each Ray worker imports them).
tis_function = SlimeISCorrection()
policy_loss = SlimePolicyLoss()

__all__ = [
    "SlimeISCorrection",
    "SlimePolicyLoss",
    "is_metrics",
    "policy_loss",
    "response_logprobs",
    "slime_metrics",
    "slime_term_inputs",
    "tis_function",
]
