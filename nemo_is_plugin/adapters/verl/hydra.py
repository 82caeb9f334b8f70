"""verl's ``PolicyLossConfig`` with a ``nemo_is`` section, so the plugin's keys live in verl's own Hydra config.

verl instantiates ``actor_rollout_ref.actor.policy_loss`` from its ``_target_``
(``verl.workers.config.PolicyLossConfig``), a dataclass that refuses unknown keys. Pointing ``_target_`` at this
subclass adds one field, ``nemo_is``: the plugin's keys (and optionally ``rollout_correction`` in verl's vocabulary),
read by the loss on every worker::

    actor_rollout_ref.actor.policy_loss.loss_mode=nemo_is.clipped_pg \\
    actor_rollout_ref.actor.policy_loss._target_=nemo_is_plugin.adapters.verl.hydra.PolicyLossConfig \\
    +actor_rollout_ref.actor.policy_loss.nemo_is.ratio_level=cumulative \\
    +actor_rollout_ref.actor.policy_loss.nemo_is.rollout_correction=decoupled_k3_rs

``nemo_is: {}`` means "verl's settings only"; an absent section (None) means "no plugin config here" (the loss then
needs ``$NEMO_IS_LOSS_CONFIG`` or a bound config, else it raises). Importing this module needs verl.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from verl.workers.config.actor import PolicyLossConfig as _VerlPolicyLossConfig


@dataclass
class PolicyLossConfig(_VerlPolicyLossConfig):
    """verl's policy-loss config plus ``nemo_is`` (the plugin's section; None = absent)."""

    nemo_is: dict[str, Any] | None = None


__all__ = ["PolicyLossConfig"]
