"""verl as ``nemo-is compat`` runs it: the installed verl's own policy loss for the config's ``loss_mode`` against the
plugin's mapping of that mode.

The config is verl's Hydra config as a YAML file -- the composed config a run saves (``.hydra/config.yaml`` of its
output directory) or any YAML holding the sections below -- read with ``defaults:`` and Hydra-style overrides
(:mod:`nemo_is_plugin.adapters.recipes`). What it reads:

- ``actor_rollout_ref.actor``: the policy-loss settings of verl's ``ActorConfig`` (:data:`ACTOR_LOSS_KEYS`); keys left
  out take verl's defaults;
- ``actor_rollout_ref.actor.policy_loss``: ``loss_mode``, verl's other loss keys, and ``nemo_is``, the plugin's section
  (its keys are the plugin keys). The compared mode is ``loss_mode`` itself when it names one of verl's losses, or the
  section's ``loss_mode`` (default ``vanilla``) when it is the plugin's ``nemo_is.clipped_pg``; every mode the verl
  adapter maps is compared (:data:`~nemo_is_plugin.adapters.verl.loss_modes.VERL_LOSS_MODES`), the modes it refuses
  (``clip_cov``, ``kl_cov``; ``bypass_mode``, below) stop the command with the reason;
- ``algorithm.rollout_correction``: verl's rollout correction, which verl's driver computes before any policy loss
  runs (``compute_rollout_correction_and_rejection_mask`` in ``verl.trainer.ppo.rollout_corr_helper``).

Per batch, as verl's driver and ``ppo_loss`` do: verl computes the IS weights and the rejection mask from
``algorithm.rollout_correction``; both losses then get the same call, ``(old_log_prob, log_prob, advantages,
response_mask, loss_agg_mode, config, rollout_is_weights)``, with ``global_batch_info`` from the batch (DP size 1).
The host is the compared mode from verl's own registry (``get_policy_loss_fn``); the plugin is the loss verl finds
under ``nemo_is.clipped_pg``, with the plugin's section in the actor config naming the same mode (a section with
nothing else is "verl's settings only").

verl's ``sapo`` and ``geo_mean`` use ``seq-mean-token-mean`` whatever ``loss_agg_mode`` says; the plugin refuses another
``loss_agg_mode`` rather than override it silently (docs/objectives.md). With verl's own ``loss_mode`` (the config a
team would swap), compat runs the plugin with ``seq-mean-token-mean`` and reports the setting as a documented
difference (a failure with ``--strict``); under ``nemo_is.clipped_pg`` the plugin's refusal stops the command, as it
would stop the run.

verl's ``bypass_mode: true`` (and ``loss_mode: bypass_mode``) is refused: verl's ``apply_bypass_mode`` then sets
``policy_loss.loss_mode`` to its own ``bypass_mode`` loss, whatever loss the config selects, so no registered loss runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from nemo_is_plugin.apps.compat.batches import CompatBatch
from nemo_is_plugin.apps.compat.compare import Outcome, run_call
from nemo_is_plugin.apps.compat.nemo_rl_host import import_host
from nemo_is_plugin.config import ConfigError

INSTALL_HINT = "install verl into this environment (pip install 'nemo-is-plugin[verl]'; see docs/verl.md, Install)"
ACTOR = "actor_rollout_ref.actor"
POLICY_LOSS = f"{ACTOR}.policy_loss"
ROLLOUT_CORRECTION = "algorithm.rollout_correction"
ACTOR_LOSS_KEYS = (
    "clip_ratio",
    "clip_ratio_low",
    "clip_ratio_high",
    "clip_ratio_c",
    "loss_agg_mode",
    "loss_scale_factor",
    "tau_pos",
    "tau_neg",
)
OTHER_POLICY_LOSS_KEYS = ("clip_cov_ratio", "clip_cov_lb", "clip_cov_ub", "kl_cov_ratio", "ppo_kl_coef", "dro_beta")
DEFAULT_LOSS_MODE = "vanilla"
BYPASS_REASON = (
    "verl's apply_bypass_mode (verl/trainer/ppo/rollout_corr_helper.py) sets policy_loss.loss_mode=bypass_mode, "
    "which replaces any registered loss, the plugin's included; compare with bypass_mode: false"
)


class VerlCompatConfigError(ConfigError):
    """A verl config ``nemo-is compat`` cannot compare (the message says why)."""


def _node(cfg: DictConfig, path: str) -> dict[str, Any]:
    node = OmegaConf.select(cfg, path, default=None)
    if node is None:
        return {}
    if not isinstance(node, DictConfig):
        raise VerlCompatConfigError(f"{path} must be a mapping, got {node!r}")
    resolved = OmegaConf.to_container(node, resolve=True)
    assert isinstance(resolved, dict)
    return {str(k): v for k, v in resolved.items() if k != "_target_"}


def compared_loss_mode(loss_mode: Any, where: str) -> str:
    """The verl loss mode compat compares, or a :class:`VerlCompatConfigError` with the one-line reason it cannot
    (the mapped and refused modes are the verl adapter's: :mod:`~nemo_is_plugin.adapters.verl.loss_modes`)."""
    from nemo_is_plugin.adapters.verl.loss_modes import REFUSED_LOSS_MODES, VERL_LOSS_MODES

    if loss_mode == "bypass_mode":
        raise VerlCompatConfigError(f"{where}={loss_mode!r}: {BYPASS_REASON}")
    if loss_mode in REFUSED_LOSS_MODES:
        raise VerlCompatConfigError(
            f"{where}={loss_mode!r}: the plugin does not compute verl's {loss_mode!r} loss, so there is nothing to "
            f"compare: {REFUSED_LOSS_MODES[loss_mode]}"
        )
    if loss_mode not in VERL_LOSS_MODES:
        raise VerlCompatConfigError(
            f"{where}={loss_mode!r}: compat compares the verl losses the plugin maps ({', '.join(VERL_LOSS_MODES)}) "
            "or the plugin's own nemo_is.clipped_pg"
        )
    return str(loss_mode)


class VerlHost:
    """The installed verl's loss for the config's ``loss_mode`` and the plugin's, built from one verl config."""

    name = "verl"

    def __init__(self, config: str | Path, overrides: list[str] | tuple[str, ...] = ()):
        from nemo_is_plugin.adapters.recipes import load_yaml
        from nemo_is_plugin.adapters.verl.config import (
            ROLLOUT_CORRECTION_DEFAULTS,
            plugin_section_keys,
            rollout_correction_keys,
        )
        from nemo_is_plugin.adapters.verl.loss_modes import FORCED_AGGREGATION
        from nemo_is_plugin.adapters.verl.policy_loss import PLUGIN_SECTION, VERL_LOSS_NAME, verl_config

        self._core = import_host("verl.trainer.ppo.core_algos", INSTALL_HINT, "verl")
        self._helper = import_host("verl.trainer.ppo.rollout_corr_helper", INSTALL_HINT, "verl")
        cfg = load_yaml(config, overrides, section=f"{POLICY_LOSS}.{PLUGIN_SECTION}")
        if all(OmegaConf.select(cfg, path, default=None) is None for path in (ACTOR, "algorithm")):
            # nothing verl reads: comparing would test verl's defaults, not this file (a silent pass)
            top = ", ".join(sorted(str(k) for k in cfg.keys())) or "(empty)"
            raise VerlCompatConfigError(
                f"{config} holds neither {ACTOR} nor algorithm.rollout_correction (top-level keys: {top}): not a verl "
                "trainer config; pass verl's Hydra config (e.g. the run's .hydra/config.yaml)"
                + ("; a bare loss_fn section is NeMo-RL's (--host nemo-rl)" if "loss_fn" in cfg else "")
            )
        actor, policy_loss = _node(cfg, ACTOR), _node(cfg, POLICY_LOSS)
        loss_mode = policy_loss.pop("loss_mode", DEFAULT_LOSS_MODE)
        section = dict(policy_loss.pop(PLUGIN_SECTION, None) or {})
        plugin_selected = loss_mode == VERL_LOSS_NAME
        if plugin_selected:  # the plugin computes the section's verl mode: that mode is the host's loss
            where = f"{POLICY_LOSS}.{PLUGIN_SECTION}.loss_mode"
            self.loss_mode = compared_loss_mode(section.pop("loss_mode", DEFAULT_LOSS_MODE), where)
        else:
            self.loss_mode = compared_loss_mode(loss_mode, f"{POLICY_LOSS}.loss_mode")
        rc = {**ROLLOUT_CORRECTION_DEFAULTS, **_node(cfg, ROLLOUT_CORRECTION)}
        if rc.get("bypass_mode"):
            raise VerlCompatConfigError(f"{ROLLOUT_CORRECTION}.bypass_mode=true: {BYPASS_REASON}")
        if rc.pop("score_centering", False):  # verl computes it in bypass mode only, from heads a dump does not hold
            raise VerlCompatConfigError(f"{ROLLOUT_CORRECTION}.score_centering=true: {BYPASS_REASON}")
        self._actor_keys = {k: actor[k] for k in ACTOR_LOSS_KEYS if actor.get(k) is not None}
        self._loss_keys = {k: policy_loss[k] for k in OTHER_POLICY_LOSS_KEYS if policy_loss.get(k) is not None}
        self._rc = {k: v for k, v in rc.items() if k not in ("bypass_mode", "loss_type")}
        self._host_agg = self._plugin_agg = self._actor_keys.get("loss_agg_mode", "token-mean")
        # setting -> why the plugin runs it differently from verl, as documented (a row of the report)
        self.deliberate_settings: dict[str, str] = {}
        forced = FORCED_AGGREGATION.get(self.loss_mode)
        if forced is not None and self._host_agg != forced and not plugin_selected:
            self._plugin_agg = forced
            self.deliberate_settings["actor.loss_agg_mode"] = (
                f"verl's {self.loss_mode!r} loss uses {forced} whatever loss_agg_mode says ({self._host_agg} here); "
                f"the plugin refuses loss_agg_mode={self._host_agg} rather than override it silently "
                f"(docs/objectives.md): compared with {forced}; set actor.loss_agg_mode={forced} to swap"
            )
        try:
            rollout_correction_keys(rc)  # verl's keys as the plugin reads them: refuses what verl does not know
            for keys in ({}, plugin_section_keys(section)):  # the parity run's and the run with the plugin keys
                keys = {"loss_mode": self.loss_mode, **keys}
                verl_config(keys, self._actor(self.loss_mode, None), self._plugin_agg, horizon=1, weights_only=False)
        except (ConfigError, ValueError, TypeError) as exc:
            raise VerlCompatConfigError(str(exc)) from exc
        self.host_keys = {
            "policy_loss.loss_mode": self.loss_mode,
            **{f"actor.{k}": v for k, v in self._actor_keys.items()},
            **{f"policy_loss.{k}": v for k, v in self._loss_keys.items()},
            "rollout_correction": self._rc,
        }
        self.plugin_keys = section
        self._plugin_loss_name = VERL_LOSS_NAME

    def _actor(self, loss_mode: str, section: dict[str, Any] | None) -> Any:
        from verl.workers.config.actor import ActorConfig, PolicyLossConfig

        if section is None:
            policy_loss = PolicyLossConfig(loss_mode=loss_mode, **self._loss_keys)
        else:
            from nemo_is_plugin.adapters.verl.hydra import PolicyLossConfig as PluginPolicyLossConfig

            policy_loss = PluginPolicyLossConfig(loss_mode=loss_mode, nemo_is=section, **self._loss_keys)
        return ActorConfig(
            strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, policy_loss=policy_loss, **self._actor_keys
        )

    def _verl_inputs(self, batch: CompatBatch, loss_agg_mode: str) -> dict[str, Any]:
        """What verl's driver and ``ppo_loss`` hand the policy loss for this batch."""
        old = batch.data["prev_logprobs"][:, 1:]
        rollout = batch.data["generation_logprobs"][:, 1:]
        mask = batch.valid.float()
        weights, verl_mask, _ = self._helper.compute_rollout_correction_and_rejection_mask(
            old, rollout, mask, **self._rc
        )
        return {
            "old_log_prob": old,
            "advantages": batch.data["advantages"][:, 1:],
            "response_mask": verl_mask.bool(),
            "loss_agg_mode": loss_agg_mode,
            "rollout_is_weights": None if weights is None else weights.batch["rollout_is_weights"],
        }

    def _call(self, loss_fn: Any, actor: Any, batch: CompatBatch, loss_agg_mode: str) -> Outcome:
        def call():
            inputs = self._verl_inputs(batch, loss_agg_mode)
            actor.global_batch_info.update(
                dp_size=1,
                batch_num_tokens=int(inputs["response_mask"].sum()),
                global_batch_size=int(batch.logprobs.shape[0]),
                loss_scale_factor=self._actor_keys.get("loss_scale_factor"),
            )
            log_prob = batch.logprobs.clone().requires_grad_(True)
            loss, metrics = loss_fn(log_prob=log_prob, config=actor, **inputs)
            return loss, metrics, log_prob

        return run_call(call)

    def run_host(self, batch: CompatBatch) -> Outcome:
        loss_fn = self._core.get_policy_loss_fn(self.loss_mode)
        return self._call(loss_fn, self._actor(self.loss_mode, None), batch, self._host_agg)

    def run_plugin(self, batch: CompatBatch, plugin_keys: dict[str, Any]) -> Outcome:
        from nemo_is_plugin.adapters.verl import VerlPolicyLoss

        # the object verl's registry holds for the entry-point registration: no bound config, the section per call
        actor = self._actor(self._plugin_loss_name, {"loss_mode": self.loss_mode, **plugin_keys})
        return self._call(VerlPolicyLoss(), actor, batch, self._plugin_agg)

    def deliberate(self, kind: str, name: str, batch: CompatBatch) -> str | None:
        return None  # in verl's decoupled mode the plugin's documented differences need plugin keys


__all__ = ["ACTOR_LOSS_KEYS", "VerlCompatConfigError", "VerlHost", "compared_loss_mode"]
