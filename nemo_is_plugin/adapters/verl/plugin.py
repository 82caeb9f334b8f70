"""verl plugin hook: importing this module registers ``nemo_is.clipped_pg`` in verl's policy-loss registry.

verl (>= 0.9) imports every entry point of its ``verl.plugins`` group at ``import verl`` (in the driver and in every Ray
worker), so with this package's entry point

    [project.entry-points."verl.plugins"]
    nemo_is = "nemo_is_plugin.adapters.verl.plugin"

a verl run selects the loss with one config entry, ``actor_rollout_ref.actor.policy_loss.loss_mode=nemo_is.clipped_pg``.
The plugin's own keys are read lazily, inside each worker, from ``actor_rollout_ref.actor.policy_loss.nemo_is`` and / or
the recipe named by ``$NEMO_IS_LOSS_CONFIG``; with neither, the first call raises (see adapters/verl/policy_loss.py).
Older verl: set ``VERL_USE_EXTERNAL_MODULES=nemo_is_plugin.adapters.verl.plugin`` instead.

It also registers the hooks of the plugin's head for verl's Megatron fused forward (``adapters/verl/head.py``: active
only where verl's model config sets ``fused_kernel_options.impl_backend=nemo_is``; on verl's FSDP models that
value is refused while verl builds the model).
"""

from nemo_is_plugin.adapters.verl.policy_loss import register_verl_loss

register_verl_loss()

from nemo_is_plugin.adapters.verl.head import install_hooks  # noqa: E402  (after the registration above)

install_hooks()  # fused_kernel_options.impl_backend=nemo_is: verl's fused forward on the plugin's head (head.py)
