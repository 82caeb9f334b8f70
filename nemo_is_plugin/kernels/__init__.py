"""Compute kernels behind the fused log-prob paths: allocation-free torch chunk math (CPU and any device) and, on
CUDA only, Triton kernels. Nothing here communicates; the chunk loops and TP reductions live in ``distributed/``."""
