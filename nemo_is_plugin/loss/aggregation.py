"""Reduce a per-token loss to the batch loss, always dividing by *global* counts (``token-sum``: by none) so that
micro-batches and DP ranks add up to the whole-batch loss (NeMo-RL's rule: local sums over global normalisers, linear
in 1/N).

m = token_mask * sample_mask, N_tok / N_seq = global valid tokens / sequences, L_i = sum_t token_mask_it (local to
the sequence, all CP shards included), eps = 1e-8 as in NeMo-RL.

=======================  ==============================================================  =================
mode                     loss                                                             peers
=======================  ==============================================================  =================
token-mean               sum_it m x / (N_tok + eps)                                       NeMo-RL token_level_loss
token-sum                sum_it m x  (no count: the loss grows with the batch)            verl
seq-mean-token-mean      sum_i s_i [sum_t tm x / (L_i + eps)] / (N_seq + eps)              NeMo-RL sequence level, GSPO
seq-mean-token-sum       sum_i s_i [sum_t tm x] / (N_seq + eps)                            verl
seq-mean-token-sum-norm  sum_i s_i [sum_t tm x / norm] / (N_seq + eps)                     Dr. GRPO (norm = max length)
=======================  ==============================================================  =================
"""

from __future__ import annotations

import torch

from nemo_is_plugin.loss.layout import TokenLayout
from nemo_is_plugin.loss.masked import EPS, where_mask

AGGREGATIONS = ("token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


def aggregate(
    x: torch.Tensor,
    token_mask: torch.Tensor,
    sample_mask: torch.Tensor,
    layout: TokenLayout,
    *,
    mode: str,
    global_valid_toks: torch.Tensor | float,
    global_valid_seqs: torch.Tensor | float,
    norm: float | None = None,
) -> torch.Tensor:
    """Aggregate per-token values x (Float[*T]) into a 0-d loss.

    Args:
        token_mask: Float[*T]; sample_mask: Float[S] (per sequence of the layout).
        mode: one of AGGREGATIONS. norm: divisor of seq-mean-token-sum-norm.
    """
    if mode in ("token-mean", "token-sum"):
        valid = token_mask * layout.to_tokens(sample_mask)
        total = where_mask(x, valid).sum()
        return total / (global_valid_toks + EPS) if mode == "token-mean" else total
    per_seq = layout.seq_sum(where_mask(x, token_mask))
    if mode == "seq-mean-token-mean":
        per_seq = per_seq / (layout.seq_sum(token_mask.to(x.dtype)) + EPS)
    elif mode == "seq-mean-token-sum-norm":
        if norm is None:
            raise ValueError("loss aggregation 'seq-mean-token-sum-norm' needs norm (loss_aggregation_norm)")
        per_seq = per_seq / norm
    elif mode != "seq-mean-token-sum":
        raise ValueError(f"unknown loss aggregation {mode!r}; expected one of {AGGREGATIONS}")
    # Under CP every rank holds the full per-sequence value: each returns its share, so that the loss summed over the
    # CP group is the single-process loss and the all-reduce's backward hands every shard its full gradient.
    return layout.replicated_share(where_mask(per_seq, sample_mask).sum()) / (global_valid_seqs + EPS)
