"""The loss's parallel entry points: ``logit_loss`` (LogitClippedPGLoss: TP-sharded logits of the local CP shard ->
log-probs -> the loss) and ``fused_linear_loss`` (fused_linear_pg_loss: hidden states and the LM-head shard -> the
loss, one pass for token-level and causal ratios). They combine the head ops with the loss; the rest of
``nemo_is_plugin.distributed`` imports neither them nor the loss."""
