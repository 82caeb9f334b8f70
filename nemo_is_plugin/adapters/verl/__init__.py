"""verl (verl-project/verl): the plugin's loss in verl's policy-loss registry, verl's config vocabulary, and the
plugin's LM head in verl's fused forwards (the Megatron engine's and the FSDP models').

- ``policy_loss``: :class:`VerlPolicyLoss` (verl's ``PolicyLossFn`` signature), :func:`register_verl_loss`,
  :func:`verl_config` (one call's loss config), :func:`dump_rollouts`; re-exported here;
- ``plugin``: the ``verl.plugins`` entry point (importing it registers ``nemo_is.clipped_pg`` and the head's hooks);
- ``config`` (``algorithm.rollout_correction``, its presets, the actor settings -> plugin keys), ``loss_modes``
  (verl's ``loss_mode`` names -> policy objectives), ``fields`` (their errors and field reader), ``correction`` (the
  rollout log-probs the loss sees), ``metrics`` (verl's ``rollout_corr/`` metrics from the loss's terms);
- ``hydra``: verl's ``PolicyLossConfig`` with a ``nemo_is`` section (imports verl; not imported here);
- ``head``: ``linear_cross_entropy`` on the plugin's head (the Megatron engine) and the hooks that install it and
  ``fsdp_head`` (the FSDP models' ``FusedLinearForPPO`` on the plugin's head).

Nothing here imports verl at package import time; ``register_verl_loss`` and ``hydra`` need it (the ``verl`` extra).
Nor does importing this package import anything but the standard library: the names below load ``policy_loss`` on
first use (PEP 562), so that the entry point (``plugin``) runs its own ``try`` around that import and, when it fails in
a verl process, installs ``plugin_guard`` instead of letting verl log the failure at DEBUG and run its own code.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from nemo_is_plugin.adapters.verl.policy_loss import (
        CONFIG_ENV,
        METRIC_PREFIX,
        PLUGIN_SECTION,
        SECTION_ENV,
        VERL_AGG_MODES,
        VERL_LOG_RATIO_CLAMP,
        VERL_LOSS_NAME,
        MissingPluginConfigError,
        VerlPolicyLoss,
        dump_rollouts,
        generation_logprobs,
        register_verl_loss,
        verl_config,
    )

__all__ = [
    "CONFIG_ENV",
    "METRIC_PREFIX",
    "MissingPluginConfigError",
    "PLUGIN_SECTION",
    "SECTION_ENV",
    "VERL_AGG_MODES",
    "VERL_LOG_RATIO_CLAMP",
    "VERL_LOSS_NAME",
    "VerlPolicyLoss",
    "dump_rollouts",
    "generation_logprobs",
    "register_verl_loss",
    "verl_config",
]


def __getattr__(name: str) -> Any:
    # only these names: ``from nemo_is_plugin.adapters.verl import head`` asks for ``head`` here first, and must get
    # an AttributeError (then the submodule), not an import of policy_loss
    if name in __all__:
        from nemo_is_plugin.adapters.verl import policy_loss

        return getattr(policy_loss, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
