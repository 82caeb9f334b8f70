"""verl plugin hook: importing this module registers ``nemo_is.clipped_pg`` in verl's policy-loss registry.

verl (>= 0.9) imports every entry point of its ``verl.plugins`` group at ``import verl`` (in the driver and in every Ray
worker), so with this package's entry point

    [project.entry-points."verl.plugins"]
    nemo_is = "nemo_is_plugin.adapters.verl.plugin"

a verl run selects the loss with one config entry, ``actor_rollout_ref.actor.policy_loss.loss_mode=nemo_is.clipped_pg``.
The plugin's own keys are read lazily, inside each worker, from ``actor_rollout_ref.actor.policy_loss.nemo_is`` and / or
the recipe named by ``$NEMO_IS_LOSS_CONFIG``; with neither, the first call raises (see adapters/verl/policy_loss.py).
Older verl: set ``VERL_USE_EXTERNAL_MODULES=nemo_is_plugin.adapters.verl.plugin`` instead.

It also registers the hooks of the plugin's head for verl's fused forwards, active only where verl's model config sets
``fused_kernel_options.impl_backend=nemo_is``: the Megatron engine's (``adapters/verl/head.py``) and the FSDP models'
(``adapters/verl/fsdp_head.py``, a ``nemo_is`` backend of verl's ``FusedLinearForPPO``).

verl logs an entry point that fails to import at DEBUG and goes on (``verl/__init__.py``, its plugin loop), which
would leave ``impl_backend=nemo_is`` on verl's own kernel and a ``nemo_is.*`` loss mode unknown to verl without a
word. So everything that can fail is imported inside the ``try`` below (the packages above this module import the
standard library alone), and a failure installs ``plugin_guard`` instead (standard library only): one warning now, and
one-line errors naming the import error and the fix at the points where verl would use what the plugin did not
install (``adapters/verl/plugin_guard.py``).
"""

try:
    from nemo_is_plugin.adapters.verl.head import install_hooks
    from nemo_is_plugin.adapters.verl.policy_loss import register_verl_loss

    register_verl_loss()
    install_hooks()  # fused_kernel_options.impl_backend=nemo_is: verl's fused forward on the plugin's head (head.py)
except Exception as exc:  # verl would only log it at DEBUG: the guard makes every use of the plugin say it
    from nemo_is_plugin.adapters.verl.plugin_guard import install_guard

    install_guard(exc)
