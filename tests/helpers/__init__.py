"""Helpers shared by test modules (importable as ``helpers.*``: pytest's ``pythonpath`` puts tests/ on the path).

``device_guard`` (the CPU guard against device-less tensors and the host-sync counter), ``devices`` (the CPU / CUDA
parametrisation), ``golden_utils`` (loading golden cases), ``golden_calls`` (every golden case as plugin calls; its
formats' runners and checks in ``golden_runners``, the call's outcome and comparison in ``golden_outcome``),
``config_cases`` (companion keys that activate each numeric config key), ``golden_ctpo`` / ``golden_verl`` (those
suites' mappings to plugin calls), ``loss_strategies`` (hypothesis strategies of random valid configs and batches).
"""
