"""Compute kernels behind the fused log-prob paths: the per-token softmax partials and their merge, the two
elementwise passes over a chunk of logits (torch in place on any device; Triton on CUDA), and the chunk GEMMs with the
in-place weight-gradient accumulator. Nothing here communicates; the chunk loops and TP reductions live in
``distributed/``."""
