"""Benchmark of the LM head -> token log-prob -> PG loss path (``nemo-is bench``).

Modules: ``shapes`` (model shapes, run config), ``device`` (CPU / CUDA timing and peak memory, the only device-specific
measurement code), ``problem`` (synthetic LM-head + RL batch), ``paths`` (the table of paths compared), ``liger`` and
``cce`` (third-party baselines), ``jobs`` (the timed callables), ``reference`` (fp32 loss / dX / dW of the whole
problem), ``measure`` (float64 errors on a few tokens), ``memory`` (peak tensor-memory tracking on CPU), ``runner`` and
``sweep`` (the run), ``report`` / ``failures`` / ``plots`` (tables, failed measurements, targets, figures; the
project's docs/performance.md is written from the saved results by ``tools/bench_docs``, not by the package),
``model_step`` / ``moe_model`` / ``model_report``
(``--model-step``: a megatron-core MoE training step), ``progress``.
"""

from nemo_is_plugin.common.extras import require_extra

require_extra("cli", __name__)  # the app imports only with its extra
