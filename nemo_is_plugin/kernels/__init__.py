"""Compute kernels behind the chunked log-prob paths; nothing here communicates (the chunk loops and the TP reductions
live in ``distributed/``): ``softmax_partials`` (per-token softmax statistics and their online merge), ``chunk_math``
(the two elementwise passes over a chunk of logits behind one interface, torch or Triton backend), ``chunk_inplace``
(the torch backend, in place), ``triton_logprob`` (the CUDA kernels), ``gemm`` (compute dtypes, the chunk GEMM, the
in-place weight-gradient accumulator), ``vocab_shard`` (a TP rank's vocab columns and its tokens' targets in them),
``chunking`` (tokens per chunk, chunk slices)."""
