"""The plugin's loss in verl's own policy-loss registry (``verl.trainer.ppo.core_algos.register_policy_loss``).

verl selects its policy loss with ``actor_rollout_ref.actor.policy_loss.loss_mode`` and calls it as

    pg_loss, pg_metrics = policy_loss_fn(old_log_prob=, log_prob=, advantages=, response_mask=,  # [B, T] each
                                         loss_agg_mode=, config=ActorConfig, rollout_is_weights=[B, T] | None)

(``verl/workers/utils/losses.py::ppo_loss``, verl 0.9.1; verl <= 0.5 returned a 4-tuple instead of the dict, which
:class:`VerlPolicyLoss` also produces when the installed verl does). Names translate as: ``log_prob`` -> current
log-probs, ``old_log_prob`` -> prev (pi_old), ``response_mask`` -> token mask, rollout log-probs -> generation.

Configuration. verl's actor settings give the defaults (:func:`~nemo_is_plugin.adapters.verl.config.actor_keys`), so
the loss with no plugin keys *is* verl's ``vanilla``. The plugin's keys come from, in increasing precedence: the config
bound at registration or, for the entry-point registration, the recipe named by ``$NEMO_IS_LOSS_CONFIG`` (its
``loss_fn`` section, or ``$NEMO_IS_LOSS_SECTION``); then the ``nemo_is`` section of verl's own
``actor_rollout_ref.actor.policy_loss`` (see :mod:`~nemo_is_plugin.adapters.verl.hydra`). Either may hold a
``rollout_correction`` entry in verl's vocabulary (keys or a preset name). With no source at all the call raises
:class:`MissingPluginConfigError` instead of running vanilla PPO. verl adds its KL loss itself
(``actor.use_kl_loss``), so ``reference_policy_kl_penalty`` must be 0 here.

Rollout weights vs rollout log-probs. verl passes its own ``rollout_is_weights``, the plugin computes its weights
from the rollout log-probs: who owns the correction, and how the weights or the bypass mode become the rollout
log-probs, is :mod:`~nemo_is_plugin.adapters.verl.correction`. The loss runs on pre-aligned tensors through
``ClippedPGLoss.compute``.

Normalisation follows verl's ``agg_loss``: with ``config.global_batch_info`` (``dp_size``, ``batch_num_tokens``,
``global_batch_size``) the loss is this micro-batch's sum / (global count / dp_size) (``token-sum``: the sum times
dp_size); without it, local counts: the rows with tokens, or every row for GMPO, as verl's ``geo_mean``. Metrics
are returned per micro-batch (verl averages them): prefixed ``actor/nemo_is/``, renormalised to this micro-batch's
own counts, plus the ``actor/pg_clipfrac``, ``actor/pg_clipfrac_lower`` and ``actor/ppo_kl`` that verl's loss of the
same mode returns, as it defines them (:class:`~nemo_is_plugin.adapters.verl.loss_modes.VerlMode`: which of
them, and whether ``ppo_kl`` clamps the log-ratio to +-20); when the plugin owns the correction, also every
``rollout_corr/`` metric verl logs, with verl's definitions, over this micro-batch, its extrema named
``<name>_micro_batch_mean`` for what verl makes of them (:mod:`~nemo_is_plugin.adapters.verl.metrics`, which says where
that scope differs from verl's batch).
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Mapping
from typing import Any

import torch

from nemo_is_plugin.adapters.host_vocabulary import host_section_keys
from nemo_is_plugin.adapters.shared import MissingPluginConfigError, given_keys, reads_rollout_logprobs
from nemo_is_plugin.adapters.verl.config import (
    VERL_AGG_MODES,
    VERL_LOG_RATIO_CLAMP,
    VerlConfigError,
    _get,
    actor_keys,
    loss_scale_factor,
    plugin_section_keys,
)
from nemo_is_plugin.adapters.verl.correction import generation_logprobs, rollout_logprobs
from nemo_is_plugin.adapters.verl.loss_modes import (
    VERL_MODES,
    VERL_WEIGHTS_LEVEL,
    verl_mode_of,
    verl_mode_settings,
)
from nemo_is_plugin.adapters.verl.policy_call import (
    METRIC_PREFIX,
    VerlSetting,
    global_counts,
    local_metrics,
    local_statistics,
    run_loss,
    verl_loss,
    verl_metric_dict,
    verl_values,
)
from nemo_is_plugin.adapters.verl.score_centering import head_inputs
from nemo_is_plugin.loss.config_model import ClippedPGLossConfig
from nemo_is_plugin.loss.objectives.nemo_rl_switches import effective_objective_of_keys, unread_clip_keys

VERL_LOSS_NAME = "nemo_is.clipped_pg"
CONFIG_ENV = "NEMO_IS_LOSS_CONFIG"
SECTION_ENV = "NEMO_IS_LOSS_SECTION"
PLUGIN_SECTION = "nemo_is"  # actor_rollout_ref.actor.policy_loss.nemo_is
__all__ = [
    "CONFIG_ENV",
    "METRIC_PREFIX",
    "MissingPluginConfigError",
    "PLUGIN_SECTION",
    "VERL_AGG_MODES",
    "VERL_LOG_RATIO_CLAMP",
    "VERL_LOSS_NAME",
    "SECTION_ENV",
    "VerlPolicyLoss",
    "dump_rollouts",
    "generation_logprobs",
    "register_verl_loss",
    "verl_config",
]


def _missing_message() -> str:
    return (
        f"{VERL_LOSS_NAME}: no plugin config on this worker. Give one of: the section "
        f"actor_rollout_ref.actor.policy_loss.{PLUGIN_SECTION} of verl's config (with policy_loss._target_="
        "nemo_is_plugin.adapters.verl.hydra.PolicyLossConfig; '{}' means verl's settings only), the recipe named "
        f"by ${CONFIG_ENV} exported to the Ray workers (+ray_kwargs.ray_init.runtime_env.env_vars.{CONFIG_ENV}="
        "/abs/path.yaml), or register_verl_loss(config=...). See docs/verl.md."
    )


def _user_keys(config: Any, section: str) -> dict[str, Any]:
    """Plugin keys from a bound config, a mapping, a master config's section or a recipe file (verl-vocabulary
    ``rollout_correction`` entries mapped, see :func:`~nemo_is_plugin.adapters.verl.config.plugin_section_keys`)."""
    if isinstance(config, ClippedPGLossConfig):
        return given_keys(config)
    from nemo_is_plugin.adapters.recipes import to_loss_mapping

    return host_section_keys(plugin_section_keys(to_loss_mapping(config, section=section)), "verl", also=("loss_mode",))


def verl_config(
    user: Mapping[str, Any], actor: Any, loss_agg_mode: str, horizon: int, weights_only: bool
) -> ClippedPGLossConfig:
    """The loss config for one verl call: verl's actor settings, overlaid by the user's explicit plugin keys.

    ``weights_only``: verl's weights multiply the loss (plugin IS off), so IS is switched on at token level with no
    truncation, which makes the plugin's weight exactly verl's.
    """
    user = dict(user)
    loss_mode = user.pop("loss_mode", "vanilla")
    if loss_mode != "vanilla" and "policy_objective" in user:
        raise VerlConfigError(
            f"the plugin section sets both loss_mode={loss_mode!r} (verl's vocabulary) and policy_objective="
            f"{user['policy_objective']!r} (the plugin's, or rollout_correction's loss_type): keep one"
        )
    base = actor_keys(actor, loss_agg_mode, loss_mode)
    if {"ratio_clip_c", "log_ratio_clip_low", "log_ratio_clip_high"} & set(user):
        base.pop("ratio_clip_c", None)
    for key in unread_clip_keys({**base, **user}):  # the objective replaces verl's PPO clip (CISPO: its dual clip)
        base.pop(key, None)
    if {"loss_aggregation", "token_level_loss"} & set(user):
        base.pop("loss_aggregation")
        base.pop("token_level_loss")
    merged = {**base, **user}
    agg = merged.get("loss_aggregation") or ("token-mean" if merged.get("token_level_loss", True) else None)
    if agg == "seq-mean-token-sum-norm" and merged.get("loss_aggregation_norm") is None:
        factor = loss_scale_factor(actor)
        merged["loss_aggregation_norm"] = float(horizon if factor is None else factor)
    if weights_only:  # at the level verl applies its weights under this objective (geo_mean: per sequence)
        level = VERL_WEIGHTS_LEVEL.get(effective_objective_of_keys(merged), "token")
        merged.update(use_importance_sampling_correction=True, is_correction_level=level)
    cfg = ClippedPGLossConfig(**merged)
    if cfg.effective_kl_penalty != 0:
        raise ValueError(
            "verl adds the KL loss itself (actor_rollout_ref.actor.use_kl_loss / kl_loss_coef): set "
            "reference_policy_kl_penalty: 0 in the plugin's config"
        )
    if cfg.positive_example_nll_weight != 0:
        raise ValueError("positive_example_nll_weight needs per-sample rewards, which verl's policy loss does not get")
    return cfg


def _returns_tuple() -> bool:
    """verl <= 0.5 policy losses returned (pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower); later a metrics dict."""
    try:
        from verl.trainer.ppo import core_algos
    except ImportError:  # called outside verl (tests, custom trainers): the current dict form
        return False
    vanilla = getattr(core_algos, "compute_policy_loss_vanilla", None)
    ann = str(inspect.signature(vanilla).return_annotation) if vanilla is not None else "dict"
    return "dict" not in ann and "tuple" in ann


def _frozen(keys: Mapping[str, Any]) -> str:
    return repr(sorted(keys.items()))


class VerlPolicyLoss:
    """The plugin's ClippedPGLoss with verl's ``PolicyLossFn`` signature (see the module docstring).

    Args:
        config: plugin keys -- a ``loss_fn`` mapping, a whole master config (only ``section`` is read), a recipe path,
            or a ``ClippedPGLossConfig`` (its explicitly set fields). None: read ``$NEMO_IS_LOSS_CONFIG`` at the first
            call (so a registration at import time reads no file) and/or the ``policy_loss.nemo_is`` section of each
            call's actor config; neither present raises :class:`MissingPluginConfigError`.
        section: the section of a master config / recipe to read.
    """

    def __init__(
        self,
        config: None | str | os.PathLike[str] | Mapping[str, Any] | ClippedPGLossConfig = None,
        *,
        section: str = "loss_fn",
    ):
        self._source, self._section = config, section
        self._bound: dict[str, Any] | None = None
        self._sections: dict[str, dict[str, Any]] = {}
        self._losses: dict[tuple, Any] = {}
        self._tuple: bool | None = None

    def _file_keys(self) -> dict[str, Any] | None:
        """Keys of the bound config, else of ``$NEMO_IS_LOSS_CONFIG``; None when there is neither."""
        if self._bound is None:
            if self._source is not None:
                self._bound = _user_keys(self._source, self._section)
            elif os.environ.get(CONFIG_ENV):
                self._bound = _user_keys(os.environ[CONFIG_ENV], os.environ.get(SECTION_ENV, self._section))
        return self._bound

    @property
    def user_keys(self) -> dict[str, Any]:
        """The plugin keys bound at registration or read from ``$NEMO_IS_LOSS_CONFIG`` (the Hydra section comes with
        each call's actor config: :meth:`keys_for`)."""
        keys = self._file_keys()
        if keys is None:
            raise MissingPluginConfigError(_missing_message())
        return keys

    def keys_for(self, actor: Any) -> dict[str, Any]:
        """The plugin keys of a call: the bound / file keys, overlaid by ``policy_loss.nemo_is`` of verl's config."""
        section = _get(_get(actor, "policy_loss"), PLUGIN_SECTION)
        base = self._file_keys()
        if section is None:
            if base is None:
                raise MissingPluginConfigError(_missing_message())
            return base
        frozen = repr(section)
        if frozen not in self._sections:
            self._sections[frozen] = plugin_section_keys(section)
        return {**(base or {}), **self._sections[frozen]}

    def resolve(
        self,
        actor: Any,
        loss_agg_mode: str,
        horizon: int,
        weights_only: bool = False,
        keys: Mapping[str, Any] | None = None,
    ):
        """The ``ClippedPGLoss`` for these verl settings (cached per distinct setting)."""
        return self._setting(actor, loss_agg_mode, horizon, keys).loss(weights_only)

    def _setting(
        self, actor: Any, loss_agg_mode: str, horizon: int, keys: Mapping[str, Any] | None = None
    ) -> VerlSetting:
        """The losses of one distinct verl setting: resolved once per call, cached per setting."""
        from nemo_is_plugin.loss import ClippedPGLoss

        keys = self.keys_for(actor) if keys is None else keys
        # The response length matters only as seq-mean-token-sum-norm's default divisor; keep it out of the key
        # otherwise, so that variable-length micro-batches share one loss.
        if loss_agg_mode != "seq-mean-token-sum-norm" or loss_scale_factor(actor) is not None:
            horizon = 0
        # verl_mode_settings: every verl field a loss mode's keys are built from (derived from loss_modes.VERL_MODES),
        # so the actor of the setting's first call builds what any call of it would
        key = (loss_agg_mode, horizon, loss_scale_factor(actor), verl_mode_settings(actor), _frozen(keys))
        if key not in self._losses:
            self._losses[key] = VerlSetting(
                lambda weights_only: ClippedPGLoss(verl_config(keys, actor, loss_agg_mode, horizon, weights_only))
            )
        return self._losses[key]

    def __call__(
        self,
        old_log_prob: torch.Tensor,
        log_prob: torch.Tensor,
        advantages: torch.Tensor,
        response_mask: torch.Tensor,
        loss_agg_mode: str = "token-mean",
        config: Any = None,
        rollout_is_weights: torch.Tensor | None = None,
        rollout_log_probs: torch.Tensor | None = None,
        **extra: Any,
    ):
        from nemo_is_plugin.loss.layout import TokenLayout

        b, t = log_prob.shape
        setting = self._setting(config, loss_agg_mode, t)
        # the plugin reads log mu (it owns the correction, or bypass mode: pi_old = mu) and reports verl's rollout_corr/
        # statistics, as verl's own bypass loss does; else verl's weights, if any, multiply the loss
        reads_mu = reads_rollout_logprobs(setting.loss(False).config)
        weights_only = not reads_mu and rollout_is_weights is not None
        loss_fn = setting.loss(weights_only)
        # verl's own metrics of the mode this config computes (vanilla's for a config no verl mode computes)
        mode = verl_mode_of(loss_fn.config) or VERL_MODES["vanilla"]
        m = response_mask.bool().to(log_prob.dtype)
        own = local_statistics(log_prob, old_log_prob, m, mode)
        # verl's geo_mean: a plain mean over the micro-batch's rows, empty ones included, when no global count is given
        counts = global_counts(config, loss_agg_mode, b if mode.all_rows else None)
        rollout = (rollout_is_weights, rollout_log_probs, reads_mu, weights_only)
        inputs = self._loss_inputs(loss_fn.config, old_log_prob, log_prob, advantages, m, rollout, own, counts, extra)
        run = run_loss(loss_fn, inputs, TokenLayout.padded(b, t, device=log_prob.device), own, reads_mu)
        loss, local = verl_loss(run, loss_agg_mode, config), local_metrics(run, counts)
        if self._tuple is None:
            self._tuple = _returns_tuple()
        if self._tuple:  # verl <= 0.5: (pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower)
            return (loss, *(torch.tensor(v, device=log_prob.device) for v in verl_values(local, mode, run.ppo_kl)))
        return loss, verl_metric_dict(run, local, mode, loss_fn.config, b, reads_mu)

    @staticmethod
    def _loss_inputs(
        cfg: ClippedPGLossConfig,
        old_log_prob: torch.Tensor,
        log_prob: torch.Tensor,
        advantages: torch.Tensor,
        m: torch.Tensor,
        rollout: tuple[torch.Tensor | None, torch.Tensor | None, bool, bool],
        own: Mapping[str, torch.Tensor],
        counts: tuple[float | None, float | None],
        extra: Mapping[str, Any],
    ) -> Any:
        """The loss's aligned inputs from verl's tensors: log mu as the rollout settings give it
        (:func:`~nemo_is_plugin.adapters.verl.correction.rollout_logprobs`; ``rollout``: verl's weights and rollout
        log-probs, whether the plugin reads mu, whether verl's weights apply), verl's head fields, and the global
        counts (``counts``, else this micro-batch's ``own`` ones)."""
        from nemo_is_plugin.loss import LossInputs

        weights, rollout_log_probs, reads_mu, weights_only = rollout
        gen = rollout_logprobs(
            cfg, reads_mu, weights_only, old_log_prob, m.bool(), weights, rollout_log_probs, loss_name=VERL_LOSS_NAME
        )
        info_tok, info_seq = counts
        return LossInputs(
            curr_logprobs=log_prob,
            prev_logprobs=old_log_prob,
            generation_logprobs=gen,
            reference_logprobs=None,
            advantages=advantages,
            token_mask=m,
            sample_mask=torch.ones(m.shape[0], dtype=m.dtype, device=m.device),
            global_valid_seqs=own["local_seqs"] if info_seq is None else info_seq,
            global_valid_toks=own["local_toks"] if info_tok is None else info_tok,
            head=head_inputs(cfg.score_centering, extra),  # verl's head fields (adapters/verl/score_centering.py)
        )


def register_verl_loss(name: str = VERL_LOSS_NAME, config: Any = None, *, section: str = "loss_fn") -> VerlPolicyLoss:
    """Register the plugin's loss under ``name`` in verl's ``POLICY_LOSS_REGISTRY``; returns the registered callable.

    verl must be importable (``pip install nemo-is-plugin[verl]``). Re-registering a name replaces it (verl's
    decorator overwrites), so module reloads are harmless.
    """
    try:
        from verl.trainer.ppo.core_algos import register_policy_loss
    except ImportError as exc:
        raise ImportError("register_verl_loss needs verl (pip install 'nemo-is-plugin[verl]')") from exc
    fn = VerlPolicyLoss(config, section=section)
    register_policy_loss(name)(fn)
    return fn


def dump_rollouts(batch: Any, step: int, path: str | os.PathLike[str] | None = None) -> int:
    """Append one PPO step's rollouts to a dump ``nemo-is diagnose`` reads; a no-op unless ``path`` or
    ``$NEMO_IS_DUMP_ROLLOUTS`` names a file. ``batch`` is verl's ``DataProto`` once advantages are computed; add
    ``dump_rollouts(batch, self.global_steps)`` after ``compute_advantage`` in ``RayPPOTrainer.fit`` (driver), with
    ``actor_rollout_ref.rollout.calculate_log_probs=True`` so that the batch holds ``rollout_log_probs``."""
    from nemo_is_plugin.adapters.rollout_dump import dump_batch

    tensors = getattr(batch, "batch", batch)
    rewards = tensors["token_level_scores"].sum(-1) if "token_level_scores" in tensors else None
    return dump_batch(
        tensors,
        step,
        path,
        rewards=rewards,
        prev="old_log_probs",
        gen="rollout_log_probs",
        mask="response_mask",
        advantages="advantages",
    )
