"""slime (THUDM/slime): the plugin's loss enabled from slime's command line, no source edit.

slime loads its custom functions by path (``slime.utils.misc.load_function``: import the module, read the attribute),
so the two entry points are attributes of this package, under these exact names:

- ``--custom-loss-function-path nemo_is_plugin.adapters.slime.policy_loss``: the whole policy loss;
- ``--custom-tis-function-path nemo_is_plugin.adapters.slime.tis_function``: the IS correction inside slime's PPO loss.

Modules: ``entry_points`` (the two entry points, :class:`SlimePolicyLoss` and :class:`SlimeISCorrection`), ``config``
(slime's flags -> plugin keys, ``LOSS_FLAGS``), ``layout`` (this rank's response tokens in slime's CP layout),
``metrics`` (the policy objective's own metrics, reduced as slime reduces its metrics). The
process groups are megatron-core's (slime's ``mpu``): slime runs with megatron-core, the ``megatron`` extra here; the
entry points read them at their first call and name the extra when megatron-core is not installed.
"""

from nemo_is_plugin.adapters.slime.entry_points import SlimeISCorrection, SlimePolicyLoss, policy_loss, tis_function

__all__ = ["SlimeISCorrection", "SlimePolicyLoss", "policy_loss", "tis_function"]
