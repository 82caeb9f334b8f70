"""The hosts' side: one package per host trainer, and what they share.

=========  ======================================  ===============================================================
host       package                                 what it offers
=========  ======================================  ===============================================================
NeMo-RL    ``nemo_is_plugin.adapters.nemo_rl``     ``NeMoRLLossFn`` / ``ClippedPGLossFn`` (NeMo-RL's LossFunction),
                                                   ``build_nemo_rl_loss_fn``, ``dump_rollouts``; the head in NeMo-RL's
                                                   fused path (``head``) and its start-up hook (``startup``)
verl       ``nemo_is_plugin.adapters.verl``        ``VerlPolicyLoss``, ``register_verl_loss``, the ``verl.plugins``
                                                   entry point (``plugin``), verl's config vocabulary, ``rollout_corr/``
                                                   metrics, the head in verl's fused forwards (``head``: Megatron,
                                                   ``fsdp_head``: FSDP)
slime      ``nemo_is_plugin.adapters.slime``       ``policy_loss`` and ``tis_function`` (loaded by slime by path),
                                                   slime's flags mapped or refused (``config``)
=========  ======================================  ===============================================================

Shared by all three: ``shared`` (who owns the rollout correction, the groups sentinel ``PARALLEL_STATE`` and how it is
read, ``MissingPluginConfigError``, the keys of a config object, metrics rescaled to other counts), ``recipes`` (YAML
recipes), ``rollout_dump`` (the dumps ``nemo-is diagnose`` reads), ``import_hooks`` (a patch run when the host's module
is imported), ``head_check`` (``python -m nemo_is_plugin.adapters.head_check nemo-rl|verl``).

Importing this package imports no host and none of its subpackages: each imports its host lazily (verl, NeMo-RL) or
reads it from the worker (slime's megatron-core groups).
"""

# host name -> (its package, its entry points); a table for readers and tests: importing it imports nothing
HOSTS = {
    "nemo_rl": ("nemo_is_plugin.adapters.nemo_rl", ("NeMoRLLossFn", "ClippedPGLossFn", "build_nemo_rl_loss_fn")),
    "verl": ("nemo_is_plugin.adapters.verl", ("VerlPolicyLoss", "register_verl_loss")),
    "slime": ("nemo_is_plugin.adapters.slime", ("policy_loss", "tis_function")),
}

__all__ = ["HOSTS"]
