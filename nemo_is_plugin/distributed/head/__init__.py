"""The LM-head ops: token log-probs from vocab-parallel logits (``vocab_parallel``) or from hidden states and the
LM-head weight shard (``fused_linear``), chunked so that no more than a chunk of logits is ever held; the head under a
Megatron decoder's sequence-first output, CP and packing included (``sequence_head``); NeMo-RL's top-k / top-p
training filter (``filtered_head``). No loss here: the entry points (``distributed.entry_points``) combine them with
it."""
