"""A key of another host's vocabulary in a host's plugin section: applied the same way in every host, or refused in
one line naming the host's own key; and the unknown-key warning naming the host whose section it is.

The plugin's keys (NeMo-RL's ``loss_fn`` keys and the plugin's own) are read alike by every adapter: NeMo-RL's
``loss_fn`` section (:class:`~nemo_is_plugin.adapters.nemo_rl.NeMoRLLossFn`, ``nemo-is validate``), verl's
``actor_rollout_ref.actor.policy_loss.nemo_is`` section and slime's ``args.nemo_is`` / ``$NEMO_IS_CONFIG``. Besides
them:

- ``rollout_correction`` (verl's ``algorithm.rollout_correction``: a preset name, a mapping of its keys, or
  ``{preset: name, <keyword>: value}``) is translated into plugin keys in every host's section, by verl's own
  translation (:func:`~nemo_is_plugin.adapters.verl.config.with_rollout_correction`); the section's plugin keys
  win over it;
- verl's actor keys that have a plugin key of the same meaning (``clip_ratio*``, ``loss_agg_mode``) are refused,
  naming the key the host reads instead (:data:`OWN_KEYS`);
- any other key no setting reads is warned about (or refused under ``NEMO_IS_STRICT_CONFIG``) naming the host's
  section, then dropped.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from nemo_is_plugin.adapters.verl.config import with_rollout_correction
from nemo_is_plugin.config import ConfigError, check_unknown_keys, strict_keys_default
from nemo_is_plugin.loss.config_model import ClippedPGLossConfig

Host = Literal["NeMo-RL", "verl", "slime"]
# Each host's plugin section, and why an unknown key in it is only warned about (unless strict).
SECTIONS: dict[str, tuple[str, str]] = {
    "NeMo-RL": ("loss_fn", "NeMo-RL accepts extra keys"),
    "verl": ("actor_rollout_ref.actor.policy_loss.nemo_is", "verl hands its nemo_is section to the plugin whole"),
    "slime": ("nemo_is", "slime hands args.nemo_is / $NEMO_IS_CONFIG to the plugin whole"),
}
# verl's actor keys whose meaning a plugin key has: in a plugin section, each is refused naming the host's own key.
OWN_KEYS: dict[str, dict[str, str]] = {
    "clip_ratio": {
        "NeMo-RL": "ratio_clip_min and ratio_clip_max",
        "verl": "actor_rollout_ref.actor.clip_ratio",
        "slime": "--eps-clip",
    },
    "clip_ratio_low": {
        "NeMo-RL": "ratio_clip_min",
        "verl": "actor_rollout_ref.actor.clip_ratio_low",
        "slime": "--eps-clip",
    },
    "clip_ratio_high": {
        "NeMo-RL": "ratio_clip_max",
        "verl": "actor_rollout_ref.actor.clip_ratio_high",
        "slime": "--eps-clip-high",
    },
    "clip_ratio_c": {
        "NeMo-RL": "ratio_clip_c",
        "verl": "actor_rollout_ref.actor.clip_ratio_c",
        "slime": "--eps-clip-c",
    },
    "loss_agg_mode": {
        "NeMo-RL": "loss_aggregation (verl's values)",
        "verl": "actor_rollout_ref.actor.loss_agg_mode",
        "slime": "--calculate-per-token-loss (slime's reducer owns the aggregation)",
    },
}


def applied_other_hosts_keys(section: Mapping[str, Any], host: Host) -> dict[str, Any]:
    """``section`` with ``rollout_correction`` translated into plugin keys (the section's own keys winning), and a
    key of :data:`OWN_KEYS` refused in one line naming ``host``'s own key."""
    keys = dict(section)
    for key, own in OWN_KEYS.items():
        if key in keys:
            where = SECTIONS[host][0]
            raise ConfigError(
                f"{where}.{key} is verl's actor key, which the plugin does not read here: set {own[host]}"
            )
    entry = keys.pop("rollout_correction", None)  # config.unknown_keys.ADAPTER_TRANSLATED_KEYS
    return keys if entry is None else with_rollout_correction(entry, keys)


def known_keys_only(keys: Mapping[str, Any], host: Host, also: tuple[str, ...] = ("name",)) -> dict[str, Any]:
    """``keys`` without the keys no setting reads (and none of ``also``, the host's own entries of the section), which
    are warned about naming ``host``'s section (refused under ``NEMO_IS_STRICT_CONFIG``)."""
    known = set(ClippedPGLossConfig.model_fields) | set(also)
    unknown = [k for k in keys if k not in known]
    section, why = SECTIONS[host]
    check_unknown_keys(unknown, known, strict=strict_keys_default(), section=section, ignored_as=why)
    return {k: v for k, v in keys.items() if k in known}


def host_section_keys(section: Mapping[str, Any], host: Host, also: tuple[str, ...] = ("name",)) -> dict[str, Any]:
    """A host's plugin section as plugin keys: other hosts' keys applied or refused, unknown keys warned and dropped."""
    return known_keys_only(applied_other_hosts_keys(section, host), host, also)


__all__ = ["OWN_KEYS", "SECTIONS", "applied_other_hosts_keys", "host_section_keys", "known_keys_only"]
