"""``nemo-is demo``: end-to-end GRPO on a tiny Megatron MoE model with a real rollout/training mismatch.

Modules, one idea each:

- ``settings``  the run configuration (pydantic) and the loss settings read from ``configs/demo``.
- ``task``      the verifiable digit-reversal task, its exact-match reward and GRPO group advantages.
- ``model``     megatron-core GPTModel (MoE, local spec, CPU) construction, CPU patches, weight gathering.
- ``decoder``   a KV-cached pure-torch decoder of the same network in emulated bf16/fp8 (the rollout path).
- ``rollout``   rollout backends: embedded CPU sampler, optional vLLM (``vllm_backend``, GPU only).
- ``policy``    the Megatron policy: log-probs (vocab-parallel), supervised warm start, GRPO update.
- ``workers``   the Ray actors wrapping ``policy`` and ``rollout``.
- ``loop``      the GRPO driver running the loss settings side by side.
- ``records``   metrics.jsonl / metrics.csv / rollouts.jsonl writers.
- ``plot``      comparison.png.

Nothing here imports torch, megatron or ray at package import time.
"""

from nemo_is_plugin.common.extras import require_extra

require_extra("demo", __name__)  # the app imports only with its extra
