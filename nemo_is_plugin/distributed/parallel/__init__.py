"""The parallel plumbing (no loss math, no LM head): which process groups there are (``groups``: ParallelGroups,
megatron-core's ``parallel_state`` read on request), autograd-aware collectives over an explicit group
(``collectives``), Megatron's CP sharding of padded and packed batches (``cp_sharding``), the CP TokenLayout
(``context_parallel``), DP counts, metrics and batch statistics (``data_parallel``) and the PP metric broadcast
(``pipeline``)."""
