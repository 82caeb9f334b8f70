"""Benchmark of the LM head -> token log-prob -> PG loss path (``nemo-is bench``).

Modules: ``shapes`` (model shapes, run config), ``problem`` (synthetic LM-head + RL batch), ``paths`` (the log-prob
paths compared), ``liger`` (Liger-Kernel baseline), ``memory`` (peak tensor-memory tracking on CPU), ``measure``
(timing, memory, float64 errors), ``runner`` (the run), ``report`` / ``plots`` / ``docs`` (table, figures, page).
"""
