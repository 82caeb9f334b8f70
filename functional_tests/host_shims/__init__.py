"""What it takes to run the hosts' own training steps on a CPU, in one place (the tests' helper, not the package).

The hosts' training steps assume a GPU: a CUDA device, NCCL, Transformer Engine, flash attention. The step tests run
them on CPU gloo processes with tiny random models; every shim here names the host's file and line it works around
and the host version it was written against, so that a host upgrade that makes one unnecessary (or wrong) can be
traced. Nothing here changes what the hosts compute: devices, process-group backends and attention kernels only.

Modules: ``verl`` (verl 0.9.1's platform, model and engine set-up), ``megatron_cpu`` (megatron-core's CUDA-only
calls, used by verl's Megatron engine), ``megatron_cp_attention`` (a core attention that takes context parallelism,
for megatron-core's local layer spec), ``nemo_rl`` (NeMo-RL @7ea279ab's DTensor v1 worker), ``nemo_rl_megatron``
(the same NeMo-RL's Megatron policy worker's ``train``: Megatron-Bridge's imports, megatron-core 0.19.2 on a CPU),
``slime`` (slime @624b824a's ``train_one_step`` on gloo processes, and the stubbed imports it needs). Shared by them:
``cuda_to_cpu`` (the device shim the NeMo-RL and slime steps enter) and ``plugin_settings`` (the plugin's settings
every step test runs).
"""
