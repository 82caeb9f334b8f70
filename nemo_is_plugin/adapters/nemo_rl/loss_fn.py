"""The plugin's loss as a NeMo-RL ``LossFunction``; enabling it in NeMo-RL is one line in ``grpo.setup``.

    # nemo_rl/algorithms/grpo.py, setup(): the loss is built as
    #     loss_fn = ClippedPGLossFn(loss_config, use_fused_linear_logprobs=use_fused_linear_logprobs)
    # with ClippedPGLossFn imported from the plugin instead of nemo_rl.algorithms.loss:
    from nemo_is_plugin.adapters.nemo_rl import ClippedPGLossFn

``ClippedPGLossFn`` (an alias of :class:`NeMoRLLossFn`) takes NeMo-RL's constructor arguments, ``(cfg,
use_fused_linear_logprobs=False)`` with ``cfg`` NeMo-RL's pydantic ``ClippedPGLossConfig`` (extra keys: the plugin's),
a mapping or the plugin's config, and exposes NeMo-RL's instance attributes with NeMo-RL's meaning. Invalid
combinations raise :class:`~nemo_is_plugin.config.ConfigValidationError`, an ``AssertionError`` like NeMo-RL's.

What NeMo-RL's workers rely on (see :mod:`nemo_is_plugin.adapters.nemo_rl.protocol`) and how this class provides it:

- ``loss_type``: TOKEN_LEVEL for ``token-mean`` aggregation, SEQUENCE_LEVEL for the per-sequence aggregations;
- ``input_type``: LOGPROB (the worker computes ``next_token_logprobs``, TP/CP-exact), or LOGIT (the worker hands over
  this rank's ``logits [B, S/CP, V/TP]`` and the loss runs through the plugin's LOGIT entry point,
  :class:`~nemo_is_plugin.distributed.entry_points.logit_loss.LogitClippedPGLoss`: chunked vocab-parallel log-probs,
  CP-sharded sequences kept sharded). The groups come from the call's ``vocab_parallel_group`` /
  ``context_parallel_group`` keywords when the host passes them, else from ``groups`` given at construction;
- ``metric_normalizations``: the global count each metric was divided by (TOKENS / SEQUENCES / NONE), so that the
  split API (every micro-batch called with ``global_valid_* = 1``, rescaled once per step) rescales each metric
  correctly; extrema, ``num_valid_samples`` and ``positive_nll_loss`` are NONE;
- ``reference_policy_kl_penalty`` (the effective beta: 0 with ``use_kl_in_reward``): ``prepare_loss_input`` adds
  ``data["curr_logprobs_unfiltered"]`` under top-k / top-p filtering when it is non-zero, and the loss's KL uses it;
- ``use_fused_linear_logprobs``: when True, NeMo-RL's Megatron model returns the next-token log-probs ``[B, S-1]``
  computed from the hidden states (no logits) and ``prepare_loss_input`` hands them over, cast to float32 and cut to
  ``S-1``, as ``next_token_logprobs``: the LOGPROB loss unchanged (GRPO refuses that mode with sequence packing and
  with top-k / top-p, and NeMo-RL's fused kernel refuses CP). It therefore requires ``input_type`` LOGPROB;
- picklable for Ray: the state is the validated config, the input type and how to find the groups; a process group
  never travels (pass ``groups="parallel_state"`` to resolve them from megatron-core inside the worker).

Loss and metrics are linear in ``1 / global_valid_*`` (NeMo-RL's rule), so micro-batching, DP sharding, NeMo-RL's
``SequencePackingLossWrapper`` (one call per packed sequence, metrics summed) and the split API all reproduce the
direct call. NeMo-RL's step (its packing wrapper and ``grpo_train``) min/max-reduces only
``probs_ratio{,_clamped}_{min,max}`` and sums every other key: the plugin's other extrema are therefore reported as
share-weighted micro-batch means under names saying so (:mod:`~nemo_is_plugin.adapters.nemo_rl.step_metrics`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypedDict

import torch
from pydantic import BaseModel

from nemo_is_plugin.adapters.host_vocabulary import host_section_keys
from nemo_is_plugin.adapters.nemo_rl.protocol import LossInputType, LossType, MetricNormalizer
from nemo_is_plugin.adapters.nemo_rl.startup import check_switch_in_effect
from nemo_is_plugin.adapters.nemo_rl.step_metrics import (
    SEQUENCE_SHARE,
    for_nemo_rl_step,
    renamed_normalizations,
    sequence_share,
)
from nemo_is_plugin.adapters.shared import PARALLEL_STATE, GroupsSpec, check_groups, given_keys, resolve_groups
from nemo_is_plugin.config import ConfigError
from nemo_is_plugin.distributed.parallel.groups import ParallelGroups
from nemo_is_plugin.loss import registry
from nemo_is_plugin.loss.config_model import ClippedPGLossConfig
from nemo_is_plugin.loss.registry import DEFAULT_LOSS_NAME

if TYPE_CHECKING:
    from nemo_is_plugin.distributed.entry_points.logit_loss import LogitClippedPGLoss
    from nemo_is_plugin.distributed.parallel.cp_sharding import CPOrder


# NeMo-RL's ClippedPGLossFn instance attributes that copy a config field (commit 7ea279ab), same names and meaning.
NEMO_RL_CONFIG_ATTRIBUTES = (
    "disable_ppo_ratio",
    "ratio_clip_min",
    "ratio_clip_max",
    "ratio_clip_c",
    "reference_policy_kl_type",
    "kl_input_clamp_value",
    "kl_output_clamp_value",
    "use_importance_sampling_correction",
    "truncated_importance_sampling_type",
    "truncated_importance_sampling_ratio",
    "truncated_importance_sampling_ratio_min",
    "use_on_policy_kl_approximation",
    "force_on_policy_ratio",
    "sequence_level_importance_ratios",
    "positive_example_nll_weight",
    "use_cispo",
)


class _LogitOptions(TypedDict):
    """The keyword arguments of the LOGIT loss (``LogitClippedPGLoss``), kept to rebuild it after unpickling."""

    cp_order: CPOrder
    host_divides_by_cp: bool
    chunk_size: int | None


def loss_type_of(config: ClippedPGLossConfig) -> Any:
    """TOKEN_LEVEL when the loss is divided by the global token count, SEQUENCE_LEVEL when by the sequence count.

    ``token-sum`` is divided by neither, and NeMo-RL's LossType cannot say so: its split API would divide the summed
    loss by a count afterwards. Refused, loudly, rather than scaled wrongly.
    """
    agg = config.effective_loss_aggregation
    if agg == "token-sum":
        raise ConfigError(
            "loss_aggregation='token-sum' divides by no count, which NeMo-RL's LossType (TOKEN_LEVEL / "
            "SEQUENCE_LEVEL) cannot express: use 'token-mean' with NeMo-RL (token-sum is verl's mode)"
        )
    return LossType.TOKEN_LEVEL if agg == "token-mean" else LossType.SEQUENCE_LEVEL


class NeMoRLLossFn:
    """A registered plugin loss (default ``nemo_is.clipped_pg``) behind NeMo-RL's ``LossFunction`` protocol.

    Args:
        cfg: NeMo-RL's ``ClippedPGLossConfig`` (as ``grpo.setup`` passes it), a ``loss_fn`` mapping (optionally with
            ``name``) or a validated plugin ``ClippedPGLossConfig``.
        use_fused_linear_logprobs: NeMo-RL's flag (``policy.megatron_cfg.use_fused_linear_logprobs``): the host
            computes the log-probs from hidden states and passes them as ``next_token_logprobs``; LOGPROB only.
        input_type: ``"logprob"`` (default) or ``"logit"``, or NeMo-RL's ``LossInputType`` member.
        groups: LOGIT only: the TP / CP groups of the logits when the host does not pass them per call. None = one
            process; a ``ParallelGroups``; or ``"parallel_state"`` = megatron-core's, looked up at the first call.
        cp_order: LOGIT only: the CP order of the logits ("load_balanced", Megatron's, or "contiguous").
        host_divides_by_cp: LOGIT only: NeMo-RL's Megatron worker divides the loss by the CP size (its losses are
            replicated over CP); the LOGIT loss of a CP rank covers only its own tokens, so it is multiplied back.
        logprob_chunk_size: LOGIT only: tokens per chunk of the log-prob kernel; None = the kernels' byte budget for
            the vocabulary shard (:func:`~nemo_is_plugin.kernels.chunking.default_chunk_size`), not a token count.
    """

    def __init__(
        self,
        cfg: Any = None,
        use_fused_linear_logprobs: bool = False,
        *,
        input_type: Any = "logprob",
        groups: GroupsSpec = None,
        cp_order: CPOrder = "load_balanced",
        host_divides_by_cp: bool = True,
        logprob_chunk_size: int | None = None,
    ):
        section = given_keys(cfg)
        name = section.get("name") or DEFAULT_LOSS_NAME
        if name == DEFAULT_LOSS_NAME:  # the plugin's keys (another registered loss reads its own)
            section = host_section_keys(section, "NeMo-RL")
        self._section = {**section, "name": name}
        self.use_fused_linear_logprobs = bool(use_fused_linear_logprobs)
        self.input_type = LossInputType(input_type.value if hasattr(input_type, "value") else str(input_type).lower())
        if self.input_type not in (LossInputType.LOGPROB, LossInputType.LOGIT):
            raise ValueError(f"input_type must be LOGPROB or LOGIT, got {self.input_type}")
        if self.use_fused_linear_logprobs and self.input_type != LossInputType.LOGPROB:
            raise ValueError(
                "use_fused_linear_logprobs=True: NeMo-RL's model returns log-probs, not logits, and prepare_loss_input "
                "passes them as next_token_logprobs; use input_type='logprob' (or use_fused_linear_logprobs=False)"
            )
        check_groups(groups, allow_none=True)
        self._groups_spec = groups
        self._logit_options = _LogitOptions(
            cp_order=cp_order, host_divides_by_cp=host_divides_by_cp, chunk_size=logprob_chunk_size
        )
        self._build()

    def _build(self) -> None:
        # the registry's loss for the section's name (not imported by name: this module's builder is
        # build_nemo_rl_loss_fn, whose loss NeMo-RL's workers can call)
        self.loss = registry.build_loss_fn(self._section)
        self.config: ClippedPGLossConfig = self.loss.config
        self._logit_loss: LogitClippedPGLoss | None = None
        if self.input_type == LossInputType.LOGIT:
            from nemo_is_plugin.distributed.entry_points.logit_loss import LogitClippedPGLoss

            self._logit_loss = LogitClippedPGLoss(self.loss, **self._logit_options)
        self.loss_type = loss_type_of(self.config)
        for name in NEMO_RL_CONFIG_ATTRIBUTES:
            setattr(self, name, getattr(self.config, name))
        self.reference_policy_kl_penalty = self.config.effective_kl_penalty
        # Each metric's denominator as the loss declares it, in the host's enum (same values), under the names
        # NeMo-RL's step gets (step_metrics: the plugin's extrema as share-weighted micro-batch means).
        declared = {name: per.value for name, per in self.loss.metric_denominators().items()}
        self.metric_normalizations = {
            name: MetricNormalizer(per) for name, per in renamed_normalizations(declared).items()
        }

    # ------------------------------------------------------------------ pickling (Ray)
    def __getstate__(self) -> dict[str, Any]:
        if isinstance(self._groups_spec, ParallelGroups) and self._groups_spec != ParallelGroups():
            raise TypeError(
                "a NeMoRLLossFn holding process groups cannot be pickled; build it with "
                f"groups={PARALLEL_STATE!r} to look the groups up inside the worker"
            )
        return {
            "section": self._section,
            "input_type": self.input_type.value,
            "groups": self._groups_spec,
            "logit": self._logit_options,
            "fused": self.use_fused_linear_logprobs,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._section, self._groups_spec, self._logit_options = state["section"], state["groups"], state["logit"]
        self.input_type = LossInputType(state["input_type"])
        self.use_fused_linear_logprobs = state.get("fused", False)
        self._build()

    # ------------------------------------------------------------------ the call
    def __call__(
        self,
        next_token_logprobs: torch.Tensor | None = None,
        data: Mapping[str, Any] | None = None,
        global_valid_seqs: Any = None,
        global_valid_toks: Any = None,
        *,
        logits: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        check_switch_in_effect()  # NEMO_IS_NEMO_RL_HEAD=1 with NeMo-RL's own head in use stops the run here
        if data is None or global_valid_seqs is None or global_valid_toks is None:
            raise TypeError("NeMoRLLossFn needs data, global_valid_seqs and global_valid_toks")
        if self.input_type == LossInputType.LOGIT:
            # Positional callers (e.g. NeMo-RL's DraftLossWrapper) pass the logits first.
            logits = logits if logits is not None else next_token_logprobs
            if logits is None:
                raise TypeError("input_type=LOGIT: pass logits=[B, S/CP, V/TP]")
            groups = resolve_groups(self._groups_spec)
            kwargs.setdefault("vocab_parallel_group", groups.tp)
            kwargs.setdefault("context_parallel_group", groups.cp)
            if "data_parallel_group" not in kwargs:  # its deprecated name, passed on as given
                kwargs.setdefault("dp_group", groups.dp)
            assert self._logit_loss is not None  # _build creates it for input_type LOGIT
            # the call's share of the step's valid sequences, read with the loss's metrics (no host read of its own)
            kwargs["extra_metric_sums"] = lambda inputs, layout: {
                SEQUENCE_SHARE: sequence_share(inputs.sample_mask, global_valid_seqs, layout)
            }
            loss, metrics = self._logit_loss(logits, data, global_valid_seqs, global_valid_toks, **kwargs)
            metrics = dict(metrics)
            return loss, for_nemo_rl_step(metrics, metrics.pop(SEQUENCE_SHARE))
        elif next_token_logprobs is None:
            raise TypeError("input_type=LOGPROB: pass next_token_logprobs=[B, S-1]")
        if not (hasattr(self.loss, "prepare") and hasattr(self.loss, "compute")):  # another registered loss
            return self.loss(
                next_token_logprobs=next_token_logprobs,
                data=data,
                global_valid_seqs=global_valid_seqs,
                global_valid_toks=global_valid_toks,
            )
        inputs, layout = self.loss.prepare(next_token_logprobs, data, global_valid_seqs, global_valid_toks)
        # the call's share of the step's valid sequences, read with the loss's metrics (no host read of its own)
        share = sequence_share(inputs.sample_mask, inputs.global_valid_seqs, layout)
        loss, metrics = self.loss.compute(inputs, layout, extra_metric_sums={SEQUENCE_SHARE: share})
        metrics = dict(metrics)
        return loss, for_nemo_rl_step(metrics, metrics.pop(SEQUENCE_SHARE))


def build_nemo_rl_loss_fn(
    config: str | os.PathLike[str] | Mapping[str, Any] | BaseModel,
    overrides: Sequence[str] = (),
    *,
    section: str = "loss_fn",
    input_type: Any = "logprob",
    groups: GroupsSpec = None,
    use_fused_linear_logprobs: bool = False,
) -> NeMoRLLossFn:
    """The :class:`NeMoRLLossFn` for a master config (path, mapping or OmegaConf), of which only ``section`` is read.

    A bare ``loss_fn`` mapping, NeMo-RL's ``ClippedPGLossConfig`` or the plugin's ``ClippedPGLossConfig`` is accepted
    too. ``overrides`` are CLI-style dotted overrides of the whole config
    (``loss_fn.is_correction_level=sequence_mean``), see :mod:`nemo_is_plugin.adapters.recipes`.
    """
    options = dict(input_type=input_type, groups=groups, use_fused_linear_logprobs=use_fused_linear_logprobs)
    if isinstance(config, BaseModel):  # a validated config object: NeMo-RL's or the plugin's
        if overrides:
            raise ValueError("overrides apply to YAML / mapping configs, not to a validated ClippedPGLossConfig")
        return NeMoRLLossFn(config, **options)
    from nemo_is_plugin.adapters.recipes import load_yaml, loss_section

    whole = load_yaml(config, overrides, section)
    keys = loss_section(whole, section)
    check_generation_for_score_centering(whole, keys)
    return NeMoRLLossFn(keys, **options)


def check_generation_for_score_centering(master: Any, keys: Mapping[str, Any]) -> None:
    """With ``score_centering: true``, refuse (one line each) the ``policy.generation`` settings of a master config
    under which vLLM's recorded head is not the distribution it sampled from
    (:mod:`nemo_is_plugin.adapters.sampler_checks`); a config without ``policy.generation`` is not checked."""
    if not keys.get("score_centering"):
        return
    from omegaconf import OmegaConf

    from nemo_is_plugin.adapters.sampler_checks import NEMO_RL_NAMES, check_sampler, nemo_rl_generation_settings

    generation = OmegaConf.select(master, "policy.generation") if OmegaConf.is_config(master) else None
    if generation is None:
        return
    container = OmegaConf.to_container(generation, resolve=True)
    section = {str(k): v for k, v in container.items()} if isinstance(container, Mapping) else {}
    settings, backend = nemo_rl_generation_settings(section)
    check_sampler(settings, NEMO_RL_NAMES, head_k=keys.get("score_centering_top_k"), engine=backend)


def dump_rollouts(
    train_data: Mapping[str, Any],
    step: int,
    path: str | os.PathLike[str] | None = None,
    *,
    rewards: torch.Tensor | None = None,
) -> int:
    """Append one GRPO step's rollouts to a dump ``nemo-is diagnose`` reads; a no-op unless ``path`` or
    ``$NEMO_IS_DUMP_ROLLOUTS`` names a file (``$NEMO_IS_DUMP_EVERY=k``: every k-th step). Returns the responses written.

    The hook, in ``nemo_rl/algorithms/grpo.py`` (``grpo_train``), on the driver, right after
    ``train_data["prev_logprobs"] = fprop_logprobs``::

        from nemo_is_plugin.adapters.nemo_rl import dump_rollouts
        dump_rollouts(train_data, step, rewards=repeated_batch["total_reward"])

    ``train_data`` holds NeMo-RL's ``[B, S]`` ``prev_logprobs``, ``generation_logprobs``, ``token_mask``,
    ``advantages`` and ``[B]`` ``sample_mask``, as the loss reads them.
    """
    from nemo_is_plugin.adapters.rollout_dump import dump_batch

    return dump_batch(
        train_data,
        step,
        path,
        rewards=rewards,
        prev="prev_logprobs",
        gen="generation_logprobs",
        mask="token_mask",
        advantages="advantages",
        sample_mask="sample_mask",
    )


# NeMo-RL's class name: ``from nemo_is_plugin.adapters.nemo_rl import ClippedPGLossFn`` is the whole swap.
ClippedPGLossFn = NeMoRLLossFn
